"""When a stage starts its own ranks (specforge_lite/scale/launch.py), what the accounting counts
(specforge_lite/targets/accounting.py) and that the recipe cards show the rehearsed commands."""

from __future__ import annotations

import pytest
import torch

from specforge_lite import SpecforgeError
from specforge_lite.targets.accounting import is_layer_weight, share_bytes, stage_summary, target_weights
from specforge_lite.scale.launch import LAUNCHER_VARIABLES, launch_plan, launched_by
from specforge_lite.scale.rendezvous import FIRST_PORT, ephemeral_low, free_port, port_free
from specforge_lite.scale.rehearse import RECIPES, card_section, load_spec, rehearsed_argv
from tests.conftest import compose

LAUNCH_ENV = (*LAUNCHER_VARIABLES, "SLURM_PROCID", "SLURM_NTASKS", "ACCELERATE_MIXED_PRECISION")


@pytest.fixture
def plain_process(monkeypatch):
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_launchers_are_recognised(plain_process):
    assert launched_by() is None
    plain_process.setenv("SLURM_PROCID", "0")  # a batch script: one task, nobody started ranks
    assert launched_by() is None
    plain_process.setenv("SLURM_NTASKS", "16")
    assert launched_by() == "srun"
    plain_process.delenv("SLURM_NTASKS")
    plain_process.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert launched_by() == "accelerate"
    plain_process.setenv("LOCAL_RANK", "0")
    assert launched_by() is not None


def test_launch_plan(plain_process):
    base = ["stage=train", "+recipe=smoke"]
    assert launch_plan(compose(base), "train") is None  # auto on a CPU: one process
    plan = launch_plan(compose([*base, "trainer.num_processes=2"]), "train")
    assert plan["nproc_per_node"] == 2 and plan["nnodes"] == 1 and plan["master_port"] > 0
    two_nodes = launch_plan(compose([*base, "trainer.num_processes=8", "trainer.num_nodes=2", "trainer.node_rank=1",
                                     "trainer.master_addr=node0"]), "train")
    assert (two_nodes["nnodes"], two_nodes["node_rank"], two_nodes["master_addr"], two_nodes["master_port"]) \
        == (2, 1, "node0", 29500)
    # one process drives vLLM however many devices; evaluate and export run in one process
    vllm = compose([*base, "trainer.num_processes=8", "sample.backend=vllm", "sample.vllm.tensor_parallel_size=8"])
    assert launch_plan(vllm, "sample") is None
    assert launch_plan(compose([*base, "trainer.num_processes=2"]), "sample") is not None
    for stage in ("evaluate", "export"):
        assert launch_plan(compose([*base, "trainer.num_processes=2"]), stage) is None
    plain_process.setenv("WORLD_SIZE", "2")  # already under a launcher: never again
    assert launch_plan(compose([*base, "trainer.num_processes=2"]), "train") is None


def test_a_free_port_is_outside_the_ephemeral_range_and_not_held():
    """A port from bind(0) may be handed to any outgoing connection before the rendezvous listens
    on it (CI failed once so: EADDRINUSE); ours are drawn below that range, and never a held one."""
    import socket

    low = ephemeral_low()
    if low is None or low - FIRST_PORT < 1024:
        pytest.skip("this kernel gives no ephemeral range with room below it")
    held = []
    try:
        for _ in range(20):
            port = free_port()
            assert FIRST_PORT <= port < low and port not in [h.getsockname()[1] for h in held]
            s = socket.socket()
            s.bind(("", port))  # the port was free: it can be listened on
            s.listen()
            held.append(s)
    finally:
        for s in held:
            s.close()


def test_a_held_port_is_drawn_again(monkeypatch):
    import random
    import socket

    if (ephemeral_low() or 0) - FIRST_PORT < 1024:
        pytest.skip("this kernel gives no ephemeral range with room below it")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        spare = next(p for p in range(FIRST_PORT, FIRST_PORT + 1000) if port_free(p))
        draws = iter([taken, taken, spare])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        assert free_port() == spare


def test_node_rank_beyond_the_nodes_is_refused(plain_process):
    with pytest.raises(SpecforgeError, match="trainer.node_rank=2"):
        launch_plan(compose(["stage=train", "+recipe=smoke", "trainer.num_nodes=2", "trainer.node_rank=2"]), "train")


def test_accounting_splits_layers_from_the_rest(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    layer_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if ".layers." in n)
    counted = target_weights(model, world=2)
    assert counted["layer_bytes_held"] == counted["layer_bytes_total"] == layer_bytes
    assert counted["other_bytes_held"] == (64 * 16 + 16) * 4  # tied embedding once, final norm
    # a 16-row weight over 3 ranks: chunks of 6 rows; a 24-row one: 8 rows
    assert share_bytes({"16x64": 1, "24x64": 2}, 3) == (6 + 8 + 8) * 64
    assert is_layer_weight("model.layers.0.mlp.up_proj.weight") and not is_layer_weight("model.embed_tokens.weight")


def test_stage_summary_compares_each_rank_with_its_share(tmp_path):
    import json

    folder = tmp_path / "accounting"
    folder.mkdir()
    shapes = {"10x100": 4}  # 4000 bytes of layers; 2 ranks: 500 each; 4 ranks: 3 rows each
    for rank, held in ((0, 2000), (1, 2000)):
        (folder / f"train.rank{rank}.json").write_text(json.dumps(
            {"stage": "train", "rank": rank, "world_size": 2, "loaded_by": "x", "layer_bytes_held": held,
             "layer_bytes_total": 4000, "layer_bytes_share": 2000, "other_bytes_held": 0, "layer_shapes": shapes}))
    assert stage_summary(tmp_path)["train"]["within_share"]
    over = stage_summary(tmp_path, world=4)["train"]
    assert over["layer_bytes_share"] == 3 * 100 * 4 and not over["within_share"]


def test_vllm_workers_are_held_to_tensor_parallel_shares(tmp_path):
    """vLLM's tensor-parallel workers report what they hold; each is a rank of the stage, its
    share every matrix split over the workers and the norms whole (as tensor parallelism keeps
    them); a worker holding the whole target is over its share."""
    from transformers import LlamaConfig

    from specforge_lite.targets import accounting

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    full = target_weights(meta_llama(config), world=1)
    norms = 2 * 2 * 16 * 4  # two norms of 16 fp32 per layer, 2 layers
    split = (full["layer_bytes_total"] - norms) // 2 + norms
    accounting.begin_stage(tmp_path, "sample")
    try:
        written = accounting.record_vllm_workers(config, [{"rank": 0, "layer_bytes": split, "other_bytes": 1},
                                                          {"rank": 1, "layer_bytes": split, "other_bytes": 1}],
                                                 torch.float32, "vllm")
        assert [w["layer_bytes_share"] for w in written] == [split, split]
        summary = stage_summary(tmp_path, world=2)["sample"]
        assert summary["within_share"] and set(summary["ranks"]) == {"vllm-tp0", "vllm-tp1"}
        accounting.begin_stage(tmp_path, "evaluate")
        accounting.record_vllm_workers(config, [{"rank": 0, "layer_bytes": full["layer_bytes_total"],
                                                 "other_bytes": 1}, {"rank": 1, "layer_bytes": 0, "other_bytes": 1}],
                                       torch.float32, "vllm")
        assert not stage_summary(tmp_path, world=2)["evaluate"]["within_share"]
    finally:
        accounting._stage.clear()


def meta_llama(config):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_cpu_workers_get_disjoint_cores(monkeypatch):
    """Tensor parallelism on CPU: vLLM's automatic binding wants a NUMA node per worker, so the
    cores are split over the workers ourselves."""
    from specforge_lite.serving.vllm.interpreter import cpu_binding

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_binding(2, None) == "0,1|2,3"
    assert cpu_binding(2, 1) == "0|1"
    assert cpu_binding(1, None) is None and cpu_binding(1, 3) == "0-2"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert cpu_binding(2, None) == "0|0"  # fewer cores than workers: they share


@pytest.mark.parametrize("recipe", ["eagle_llama70b", "distill_llama70b", "eagle_llama8b", "medusa_llama8b",
                                    "peagle_llama8b", "dflash_llama8b", "dflash_llama70b", "dspark_llama8b", "eagle_qwen3_8b",
                                    "eagle_qwen3_30b_a3b"])
def test_cards_show_the_rehearsed_commands(recipe):
    """The card's commands section is the one commands.yaml makes (python -m specforge_lite.scale.rehearse --cards)."""
    spec = load_spec(recipe)
    card = (RECIPES / recipe / "README.md").read_text()
    assert card_section(spec) in card, f"run: python -m specforge_lite.scale.rehearse --cards"
    for command in (c for c in spec["commands"] if c.get("rehearse") is not False):  # the GPU node's own skipped
        argv = rehearsed_argv(command["run"], {"target.path": "STAND_IN", "trainer.num_processes": "2"})
        assert argv[-2:] == ["target.path=STAND_IN", "trainer.num_processes=2"]
        assert "target.path=LOCAL_DIR" not in argv  # the card's own value gives way to the stand-in's


def test_the_failure_that_ended_a_run_is_not_the_sigterm_the_launcher_sent():
    """Rank 1 reports a user error (exit 2), the launcher stops rank 0 with SIGTERM in the same
    second: the command's status and line are rank 1's; a rank killed by another signal wins."""
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from specforge_lite.scale.launch import first_failure

    def failure(rank, exitcode):
        made = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="")
        made.timestamp = 1_000
        return made

    stopped, user_error = failure(0, -signal.SIGTERM), failure(1, 2)
    assert first_failure({0: stopped, 1: user_error}) == (1, user_error)
    killed = failure(0, -signal.SIGKILL)
    assert first_failure({0: user_error, 1: killed}) == (1, killed)
