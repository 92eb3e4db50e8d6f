"""How vLLM's counters become our numbers (no vLLM needed: the counters are data)."""

from omegaconf import OmegaConf

from specforge_lite.drafters.methods import VLLM_METHODS
from specforge_lite.serving.vllm.engine import prompt_seed, sampling_params
from specforge_lite.serving.vllm.report import report_section


def _output(tokens, drafts=0, accepted_per_position=(), iterations=None):
    accepted = sum(accepted_per_position)
    return {"token_ids": tokens, "finish_reason": "length", "seconds": 1.0,
            "counters": {"num_drafts": drafts, "num_draft_tokens": 3 * drafts, "num_accepted_tokens": accepted,
                         "accepted_per_position": list(accepted_per_position),
                         "iterations": iterations if iterations is not None else len(tokens)}}


def test_counters_to_tau_and_per_position():
    from specforge_lite.config.schema import VllmConfig

    cfg = OmegaConf.create({"eval": {"num_draft_tokens": 3, "temperature": 0.0,
                                     "vllm": OmegaConf.structured(VllmConfig)}})
    # 10 tokens: prefill gives 1, then 4 verify steps give 9 (accepted 3, 1, 0, 1 -> 4+2+1+2)
    spec = _output(list(range(10)), drafts=4, accepted_per_position=(3, 1, 1), iterations=5)
    plain = _output(list(range(10)))
    ours = {"plain": {"tau": 1.0, "tokens_per_s": 10.0, "per_position_acceptance": []},
            "eagle3": {"tau": 2.25, "tokens_per_s": 12.0, "per_position_acceptance": [0.75, 1 / 3, 1.0]}}
    results = {"vllm_plain": {"outputs": [plain], "load_s": 1, "speculative_config": None, "vllm_version": "x"},
               "vllm_eagle3": {"outputs": [spec], "load_s": 1, "speculative_config": {}, "vllm_version": "x"}}
    section = report_section(results, {"methods": ours}, [list(range(10))], cfg)["methods"]
    assert section["vllm_plain"]["tau"] == 1.0 and section["vllm_plain"]["vllm_mean_acceptance_length"] is None
    e = section["vllm_eagle3"]
    assert e["decoding_forwards"] == 4 and e["tau"] == 9 / 4
    assert e["vllm_mean_acceptance_length"] == 1 + 5 / 4
    assert e["vllm_per_position_rate"] == [3 / 4, 1 / 4, 1 / 4]
    assert e["per_position_acceptance"] == [3 / 4, 1 / 3, 1.0]
    assert e["tau_difference"] == 0.0 and e["identical_to_plain"] and e["identical_to_vllm_plain"]


def test_sampling_params_and_seeds():
    greedy = sampling_params(8, 0.0, 0.9, [2], seeds=[1])
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0 and "seeds" not in greedy
    assert greedy["stop_token_ids"] == [2] and greedy["detokenize"] is False
    assert sampling_params(8, 0.7, 0.9, [2], seeds=[5])["seeds"] == [5]
    assert prompt_seed(0, [1, 2]) == prompt_seed(0, [1, 2]) != prompt_seed(1, [1, 2])
    assert all(m.startswith("vllm_") for m in VLLM_METHODS)


def test_process_layout_on_cpu(monkeypatch):
    """On a CPU vLLM runs engine and worker in the runner's process unless tensor parallelism
    needs workers (or the user says single_process=false); the thread count follows cpu_threads."""
    from specforge_lite.config.schema import VllmConfig
    from specforge_lite.serving.vllm.interpreter import engine_kwargs, runner_env

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    default, two_threads = OmegaConf.structured(VllmConfig), OmegaConf.structured(VllmConfig(cpu_threads=2))
    kwargs, env = engine_kwargs("m", "float32", default, 0), runner_env(default)
    assert kwargs["distributed_executor_backend"] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert runner_env(two_threads)["OMP_NUM_THREADS"] == "2"
    for separate in (VllmConfig(single_process=False, cpu_threads=2), VllmConfig(tensor_parallel_size=2)):
        vcfg = OmegaConf.structured(separate)
        env = runner_env(vcfg)
        assert "distributed_executor_backend" not in engine_kwargs("m", "float32", vcfg, 0)
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert runner_env(OmegaConf.structured(VllmConfig(single_process=False, cpu_threads=2))
                      )["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
