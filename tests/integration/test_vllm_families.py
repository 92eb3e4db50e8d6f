"""vLLM serving an EAGLE-3 export trained for a Qwen3 target (issue 53): the Qwen3-8B card's
tiny stand-in (specforge_lite/scale/rehearse.py: its layer layout and q/k norms kept, a head size
vLLM's CPU attention takes), trained briefly, exported, and served by vLLM as the export's README
says: output equal to our plain decoding, and the aux layers vLLM feeds the drafter are the ones
the export records, chosen by the drafter's rule from the stand-in's depth. Needs vLLM as
tests/integration/test_vllm.py does."""

from __future__ import annotations

import json

import pytest

from specforge_lite.drafters.eagle_family import default_aux_layers
from specforge_lite.scale.rehearse import build_stand_in, load_spec
from tests.conftest import run_cli
from tests.integration.test_vllm import vllm_python  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_serves_an_eagle3_export_trained_for_qwen3(tmp_path, vllm_python):  # noqa: F811
    target = build_stand_in(load_spec("eagle_qwen3_8b"), tmp_path / "stand_in", ranks=1)["target.path"]
    config = json.loads((tmp_path / "stand_in" / "target" / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    run_dir = tmp_path / "run"
    args = ["+recipe=smoke", f"target.path={target}", "target.dtype=float32", f"run_dir={run_dir}",
            "drafter.aux_layer_ids=null", "data.max_samples=4", "sample.max_new_tokens=16", "train.max_steps=4",
            "train.checkpoint_every=0", "train.tracker=none", "export.speculative_tokens=3"]
    for stage in ("sample", "train", "export"):
        run_cli(stage, *args, check=True, timeout=900)
    run_cli("evaluate", *args, "eval.max_prompts=2", "eval.max_new_tokens=16", "eval.num_draft_tokens=3",
            "eval.plots=false", "eval.cost_repeats=1", "eval.warmup=0", "eval.engine=static",
            "eval.methods=[plain,eagle3,vllm_eagle3]", "eval.best_k_method=null", check=True, timeout=900)
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    served = report["vllm"]["methods"]["vllm_eagle3"]
    assert "error" not in served, served
    assert served["identical_to_plain"] and served["counters"]["num_drafts"] > 0
    exported = json.loads((run_dir / "export" / "speculators" / "config.json").read_text())
    aux = exported["eagle_aux_hidden_state_layer_ids"]
    assert served["draft_as_read"]["aux_hidden_state_layer_ids"] == aux
    assert aux == list(default_aux_layers(config["num_hidden_layers"]))
