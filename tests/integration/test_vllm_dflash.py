"""Real vLLM in the loop for DFlash (marker `vllm`): our SmolLM2 DFlash export served by vLLM
as the export's README tells users to serve it, non-causal and causal.

vLLM 0.32's CPU attention backend supports non-causal attention, so both variants serve on
CPU; where a backend does not, the causal variant (`drafter.causal=true`) is the one to serve.
Needs vLLM as tests/integration/test_vllm.py does (skipped without it, failed under
SPECFORGE_LITE_REQUIRE_VLLM=1).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.integration.test_vllm import RECIPE, TAU_TOLERANCE, smollm2_samples, vllm_python  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def samples(tmp_path_factory, vllm_python):  # noqa: F811
    """One samples folder for both variants and test_vllm's (their content key holds no drafter
    setting): made once per session."""
    return smollm2_samples("+recipe=dflash_smollm2", *(a for a in RECIPE if not a.startswith("+recipe=")),
                           f"run_dir={tmp_path_factory.mktemp('dflash_samples')}")


@pytest.mark.parametrize("causal", [False, True])
def test_vllm_serves_dflash_export_losslessly_and_counts_like_us(tmp_path, vllm_python, samples, causal):  # noqa: F811
    """The export loads in vLLM as {"method": "dflash", "model": DIR, "num_speculative_tokens": S - 1};
    speculative output equals our plain decoding, every step drafts the block's S - 1 tokens and
    vLLM's tau agrees with our engine's for the same drafter."""
    args = ["+recipe=dflash_smollm2", *(a for a in RECIPE if not a.startswith("+recipe=")),
            f"run_dir={tmp_path}", f"samples_dir={samples}", "drafter.block_size=4",
            f"drafter.causal={str(causal).lower()}"]
    for stage in ("train", "export"):
        run_cli(stage, *args, check=True, timeout=900)
    run_cli("evaluate", *args, "eval.max_prompts=3", "eval.max_new_tokens=16", "eval.num_draft_tokens=3",
            "eval.plots=false", "eval.cost_repeats=1", "eval.cost_widths=4", "eval.warmup=0", "eval.engine=static",
            "eval.rounding_baseline=false", "eval.methods=[plain,dflash,vllm_dflash]", check=True, timeout=1200)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    served = report["vllm"]["methods"]["vllm_dflash"]
    assert "error" not in served, served
    assert served["speculative_config"] == {"method": "dflash", "model": str(tmp_path / "export" / "speculators"),
                                            "num_speculative_tokens": 3}
    assert served["identical_to_plain"]
    # vLLM feeds the drafter the target layers our export records
    exported = json.loads((tmp_path / "export" / "speculators" / "config.json").read_text())
    assert served["draft_as_read"]["aux_hidden_state_layer_ids"] == exported["aux_hidden_state_layer_ids"]
    assert served["counters"]["num_drafts"] > 0
    assert served["counters"]["num_draft_tokens"] == 3 * served["counters"]["num_drafts"]
    assert abs(served["tau"] - report["methods"]["dflash"]["tau"]) <= TAU_TOLERANCE, (
        served["tau"], report["methods"]["dflash"]["tau"])
