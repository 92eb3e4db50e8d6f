"""An evaluate of vllm_* methods only (vLLM alone, serving/engines.py), without vLLM: the path choice,
the door, the report built from the runner's output dicts (serving/vllm_side/vllm_runner.py's schema,
written by hand as tests/unit/test_vllm_counting.py does), and that no target is loaded."""

import json

import pytest
from omegaconf import OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.measurement.recommend import recommend
from specforge_lite.drafters.methods import engine_needed, vllm_only_methods, vllm_override
from specforge_lite.serving.engines import alone_markdown, alone_measured
from specforge_lite.serving.vllm.report import Vllm
from specforge_lite.stages.evaluate_entries import build_report
from specforge_lite.scale.sizing import check_stage
from tests.conftest import compose, run_cli

SMOKE = ["+recipe=smoke", "eval.max_prompts=2", "eval.bootstrap.resamples=100"]


def _output(tokens, iterations, seconds, drafts=0, accepted_per_position=()):
    """One answer as vllm_runner.py replies it (one_at_a_time: the counters are this call's)."""
    return {"token_ids": list(tokens), "finish_reason": "length", "seconds": seconds,
            "counters": {"num_drafts": drafts, "num_draft_tokens": 2 * drafts,
                         "num_accepted_tokens": sum(accepted_per_position),
                         "accepted_per_position": list(accepted_per_position), "generation_tokens": len(tokens),
                         "prompt_tokens": 5, "iterations": iterations}}


def _results():
    # two prompts of 9 answer tokens each: plain decodes each in one prefill and 8 iterations; ngram
    # answers prompt a in half the iterations and half plain's time, prompt b as plain, but differently
    plain = [_output(range(9), 9, 1.0), _output(range(9), 9, 1.0)]
    ngram = [_output(range(9), 5, 0.5, drafts=4, accepted_per_position=(4, 0)),
             _output([0, 1, 2, 3, 4, 5, 6, 7, 99], 9, 1.0)]
    return {"vllm_plain": {"outputs": plain, "load_s": 2.0, "speculative_config": None, "vllm_version": "0.x"},
            "vllm_ngram": {"outputs": ngram, "load_s": 2.0, "speculative_config": {"method": "ngram"},
                           "vllm_version": "0.x"}}


def test_the_path_choice_and_the_override():
    def ecfg(methods, extra=()):
        return OmegaConf.create({"methods": methods, "extra_drafters": list(extra)})

    assert not engine_needed(ecfg(["vllm_plain", "vllm_eagle3"]))
    assert not engine_needed(ecfg(["vllm_eagle3"]))
    assert engine_needed(ecfg(["plain", "vllm_eagle3"])) and engine_needed(ecfg(["eagle3", "vllm_eagle3"]))
    assert engine_needed(ecfg(["vllm_eagle3"], ["mine:/some/folder"]))  # a labelled drafter decodes in ours
    assert vllm_only_methods(ecfg(["vllm_eagle3"])) == ["vllm_plain", "vllm_eagle3"]  # the baseline added
    assert vllm_only_methods(ecfg(["vllm_eagle3", "vllm_plain"])) == ["vllm_plain", "vllm_eagle3"]
    assert vllm_override(ecfg(["plain", "eagle3", "ngram", "hf_generate"]), 8) == \
        "eval.methods=[vllm_plain,vllm_eagle3,vllm_ngram] eval.vllm.tensor_parallel_size=8"


def test_report_against_vllm_plain():
    cfg = compose(SMOKE + ["stage=evaluate", "eval.temperature=0"])
    prompts = [{"id": "a", "category": "x", "turns": ["hi"]}, {"id": "b", "category": "y", "turns": ["yo"]}]
    vllm, results = Vllm(), _results()
    rows, entries, conventions, fields = alone_measured(cfg, vllm, results, prompts, [[1, 2, 3, 4, 5]] * 2, "out")
    report = build_report(cfg, prompts, rows, entries, conventions, **fields)
    report["recommendation"] = recommend(report)
    report["vllm"] = vllm.report_section(results, report, None, cfg)
    assert report["baseline"] == "vllm_plain" and report["recommendation"]["baseline"] == "vllm_plain"
    plain, ngram = report["methods"]["vllm_plain"], report["methods"]["vllm_ngram"]
    assert plain["tau"] == 1.0 and plain["speedup"] == 1.0 and plain["identical_to_plain"]
    # ngram: both answers' tokens over both answers' time, against plain's; tau: decoded tokens over forwards
    assert ngram["tokens_per_s"] == pytest.approx(18 / 1.5) and ngram["speedup"] == pytest.approx((18 / 1.5) / 9)
    assert ngram["tau"] == pytest.approx(16 / 12)
    assert ngram["identical_to_plain"] is False and ngram["identical_answers"] == "1/2"
    assert ngram["num_prompts"] == 2 and len(ngram["speedup_ci"]) == 2 and len(ngram["tau_ci"]) == 2
    assert ngram["speedup_ci"][0] <= ngram["speedup"] <= ngram["speedup_ci"][1]
    assert ngram["per_category"]["x"]["speedup"] == pytest.approx(2.0)
    assert report["vllm"]["baseline"] == "vllm_plain"
    assert report["vllm"]["methods"]["vllm_ngram"]["identical_to_vllm_plain"] is False
    assert "identical_to_plain" not in report["vllm"]["methods"]["vllm_ngram"]  # no plain of ours to compare
    # a method whose output differs is not recommended: the baseline is deployed
    assert report["recommendation"]["deploy"] == "vllm_plain"
    report["turns"], report["skipped"] = "every prompt has one turn", {}
    text = alone_markdown(report, vllm) + vllm.markdown(report["vllm"], cfg)
    assert "Baseline: **vllm_plain**" in text and "speedup vs vllm_plain" in text and "NO (1/2)" in text
    assert "identical to vllm_plain" in text and "our plain" not in text


def test_the_door_refuses_only_where_our_engine_is_needed():
    small = ["stage=evaluate", "device_memory_gib=0.001"]  # the tiny target (a few MB) against 1 MB
    check_stage(compose(SMOKE + small + ["eval.methods=[vllm_plain,vllm_ngram]", "eval.vllm.tensor_parallel_size=8",
                                          "eval.vllm.gpu_memory_utilization=1.0"]),
                "evaluate", ("evaluate", "evaluate_vllm"))  # vLLM's share of the target fits: no refusal
    with pytest.raises(SpecforgeError) as err:
        check_stage(compose(SMOKE + small + ["eval.methods=[plain,ngram,vllm_ngram]"]),
                    "evaluate", ("evaluate", "evaluate_vllm"))
    message = str(err.value)
    assert "evaluate in vLLM alone: eval.methods=[vllm_plain,vllm_ngram] eval.vllm.tensor_parallel_size=" in message
    tp = int(message.split("eval.vllm.tensor_parallel_size=")[1].split()[0])
    # the override it names passes the same door
    check_stage(compose(SMOKE + small + ["eval.methods=[vllm_plain,vllm_ngram]",
                                          f"eval.vllm.tensor_parallel_size={tp}"]),
                "evaluate", ("evaluate", "evaluate_vllm"))


def test_vllm_only_evaluate_loads_no_target(tmp_path, monkeypatch):
    """The stage with vllm_* methods only: tokenizer and prompts, the vLLM methods (their
    runner replaced by recorded replies), a report against vllm_plain; targets.load_target is
    never called and the accounting records no layer weights held."""
    import specforge_lite.stages.evaluate as evaluate
    import specforge_lite.targets.loading as targets
    from specforge_lite.targets.accounting import begin_stage, stage_summary
    from specforge_lite.serving.vllm import report as vllm_report

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(targets, "load_target", refuse)
    monkeypatch.setattr(evaluate, "load_target", refuse)
    calls = []

    def replies(cfg, methods, requests, target, out, seed_of):
        calls.append((methods, target.model, target.dtype))
        recorded = _results()
        return {name: {**recorded[name], "outputs": [recorded[name]["outputs"][i % 2] for i in range(len(requests))]}
                for name in methods}

    monkeypatch.setattr(vllm_report, "run_methods", replies)
    cfg = compose(SMOKE + ["stage=evaluate", "eval.methods=[vllm_ngram]", f"run_dir={tmp_path}"])
    begin_stage(tmp_path, "evaluate")
    evaluate.run(cfg)
    assert calls == [(["vllm_plain", "vllm_ngram"], None, "float32")]  # the smoke target's dtype, no model
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["baseline"] == "vllm_plain" and set(report["methods"]) == {"vllm_plain", "vllm_ngram"}
    assert report["turns"].startswith(("first turns only", "every prompt has one turn"))
    assert "Baseline: **vllm_plain**" in (tmp_path / "eval" / "report.md").read_text()
    summary = stage_summary(tmp_path)["evaluate"]
    assert summary["layer_bytes_peak"] == 0 < summary["layer_bytes_total"] and summary["within_share"]


def test_missing_vllm_interpreter_stops_a_vllm_only_evaluate_at_the_door(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_VLLM_PYTHON", str(tmp_path / "no_such_python"))
    proc = run_cli("evaluate", *SMOKE, "eval.methods=[vllm_plain]", f"run_dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no_such_python" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "eval").exists() and not (tmp_path / "accounting").exists()  # nothing loaded


def test_the_rehearsal_runs_our_engine_twins_of_a_vllm_only_card_command():
    from specforge_lite.scale.rehearse import engine_twins, load_spec

    card = {c["label"]: c["run"] for c in load_spec("eagle_llama70b")["commands"]}
    assert "eval.methods=[vllm_plain,vllm_eagle3,vllm_ngram] eval.vllm.tensor_parallel_size=8" in card["evaluate"]
    assert engine_twins(card["evaluate"]) == "[plain,eagle3,ngram]"
    assert engine_twins(card["train"]) is None
