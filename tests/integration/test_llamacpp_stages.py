"""llama.cpp through the stages (marker `llamacpp`): `export.gguf=true` writes export/gguf from
the trained drafter, the `llamacpp_*` evaluate methods decode the report's own requests in real
llama.cpp (xllamacpp) on the tiny smoke target, and what llama.cpp cannot run is refused at the
door with one line and exit 2 before anything is written.

The door cases need no llama.cpp; the others are skipped without xllamacpp (an error instead with
SPECFORGE_LITE_REQUIRE_LLAMACPP=1, as in CI).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from specforge_lite.serving.llamacpp.runner import INSTALL_HINT, available
from tests.integration.test_bad_inputs import assert_user_error, cli, in_process

pytestmark = [pytest.mark.llamacpp]

# the smoke recipe with the aux layers llama.cpp taps ([2, N/2, N-3]: [2, 3, 3] on the 6-layer tiny target)
SMOKE = ["+recipe=smoke", "drafter.aux_layer_ids=null", "train.max_steps=8"]
EVAL = ["eval.max_prompts=2", "eval.max_new_tokens=24", "eval.num_draft_tokens=3", "eval.plots=false",
        "eval.best_k_method=null"]


@pytest.fixture(scope="module")
def llamacpp():
    if not available():
        if os.environ.get("SPECFORGE_LITE_REQUIRE_LLAMACPP") == "1":
            pytest.fail(f"SPECFORGE_LITE_REQUIRE_LLAMACPP=1 but xllamacpp is not installed: {INSTALL_HINT}")
        pytest.skip(f"xllamacpp is not installed ({INSTALL_HINT})")


def stage(*args: str) -> None:
    code = in_process(*args)
    assert code == 0, f"{args} exited with {code}"


@pytest.fixture(scope="module")
def exported(llamacpp, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("llamacpp_smoke")
    stage("train", *SMOKE, f"run_dir={run_dir}")
    stage("export", *SMOKE, f"run_dir={run_dir}", "export.gguf=true")
    return run_dir


def test_export_gguf_writes_the_pair_llamacpp_loads(exported):
    folder = exported / "export" / "gguf"
    info = json.loads((folder / "gguf.json").read_text())
    assert {p.name for p in folder.iterdir()} == {"target.gguf", "eagle3.gguf", "gguf.json", "README.md"}
    assert info["spec_type"] == "draft-eagle3" and info["extract_layers"] == [2, 3, 3]
    assert info["load_check"]["ran"] and info["load_check"]["identical_to_plain"]
    assert info["load_check"]["drafted"] > 0
    assert info["command"] in (folder / "README.md").read_text()
    assert json.loads((exported / "export" / "export.json").read_text())["gguf"]["path"] == str(folder)


def test_llamacpp_methods_evaluate_the_same_requests_losslessly(exported):
    stage("evaluate", *SMOKE, *EVAL, f"run_dir={exported}",
          "eval.methods=[plain,llamacpp_plain,llamacpp_eagle3,llamacpp_ngram]")
    report = json.loads((exported / "eval" / "report.json").read_text())
    section = report["llamacpp"]
    assert list(section["methods"]) == ["llamacpp_plain", "llamacpp_eagle3", "llamacpp_ngram"]
    assert section["failed"] == {}
    answers = report["num_answers"]
    for name, entry in section["methods"].items():
        assert entry["identical_to_llamacpp_plain"] is True, name
        assert entry["num_answers"] == answers and entry["num_tokens"] == answers * 24
        assert entry["tokens_per_s"] > 0 and entry["tokens_per_s_ci"][0] <= entry["tokens_per_s_ci"][1]
    assert section["methods"]["llamacpp_plain"]["tau"] == 1.0
    eagle = section["methods"]["llamacpp_eagle3"]
    assert eagle["drafted"] > 0 and eagle["spec_type"] == "draft-eagle3" and eagle["draft_gguf"] == "eagle3.gguf"
    assert eagle["tau"] == pytest.approx((eagle["num_tokens"] - answers) / eagle["decoding_forwards"])
    assert "llamacpp" not in report["methods"]  # our own table holds our own methods only
    assert "## llama.cpp (xllamacpp" in (exported / "eval" / "report.md").read_text()


def test_distilled_draft_model_exports_and_evaluates_in_llamacpp(llamacpp, tmp_path):
    recipe = ["+recipe=smoke_distilled", "train.max_steps=4"]
    stage("train", *recipe, f"run_dir={tmp_path}")
    stage("export", *recipe, f"run_dir={tmp_path}", "export.gguf=true")
    info = json.loads((tmp_path / "export" / "gguf" / "gguf.json").read_text())
    assert info["draft"] == "draft_model.gguf" and info["spec_type"] == "draft-simple"
    assert info["load_check"]["identical_to_plain"]
    stage("evaluate", *recipe, *EVAL, f"run_dir={tmp_path}", "eval.max_prompts=1", "eval.methods=[llamacpp_distilled]")
    section = json.loads((tmp_path / "eval" / "report.json").read_text())["llamacpp"]
    assert list(section["methods"]) == ["llamacpp_plain", "llamacpp_distilled"]  # plain is always the reference
    assert section["methods"]["llamacpp_distilled"]["identical_to_llamacpp_plain"] is True
    assert section["methods"]["llamacpp_distilled"]["drafted"] > 0


# --------------------------------------------------------------------------- at the door

REFUSED = [
    ("export", ["+recipe=smoke_medusa"], "export.gguf=true: llama.cpp has no Medusa drafter"),
    ("run", ["+recipe=smoke_peagle"], "export.gguf=true: llama.cpp has no P-EAGLE drafter"),
    ("train", ["+recipe=smoke"], "drafter.aux_layer_ids=[1, 3, 4]: llama.cpp taps layers [2, 3, 3]"),
    ("train", [*SMOKE, "drafter.norm_before_fc=true"], "drafter.norm_before_fc=true: the EAGLE-3.1 norms"),
]


@pytest.mark.parametrize("stage_name, overrides, message", REFUSED, ids=["medusa", "peagle", "aux", "norms"])
def test_export_gguf_refuses_what_llamacpp_cannot_run(capsys, tmp_path, stage_name, overrides, message):
    code, err = cli(capsys, stage_name, *overrides, f"run_dir={tmp_path}", "export.gguf=true")
    assert_user_error(code, err, message)
    assert len(err.strip().splitlines()) == 1, err
    assert not [p for p in tmp_path.iterdir() if p.name != "logs"]  # nothing trained, sampled or exported


def test_llamacpp_methods_without_xllamacpp_are_refused_at_the_door(capsys, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xllamacpp" else real(name, *a))
    code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={tmp_path}", "eval.methods=[plain,llamacpp_ngram]",
                    "eval.best_k_method=null")
    assert_user_error(code, err, "eval.methods ['llamacpp_ngram']: llama.cpp (xllamacpp) is not installed; make llamacpp")
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "eval").exists()


def test_llamacpp_draft_methods_need_an_exported_gguf(capsys, tmp_path):
    code, err = cli(capsys, "evaluate", *SMOKE, f"run_dir={tmp_path}", "eval.methods=[llamacpp_eagle3]")
    assert_user_error(code, err, f"llamacpp_eagle3 needs {tmp_path}/export/gguf/eagle3.gguf")
    code, err = cli(capsys, "run", *SMOKE, f"run_dir={tmp_path}", "eval.methods=[llamacpp_eagle3]")
    assert_user_error(code, err, "which `run` writes only after evaluating")


def test_one_catalogue_names_the_llamacpp_methods():
    from specforge_lite.drafters.methods import LLAMACPP_METHODS, known
    from specforge_lite.serving.llamacpp.checks import DRAFT_OF
    from specforge_lite.serving.llamacpp.runner import METHODS

    assert set(METHODS) == set(LLAMACPP_METHODS) <= set(known())
    assert set(DRAFT_OF) == {m for m in LLAMACPP_METHODS
                             if m in ("llamacpp_eagle3", "llamacpp_distilled", "llamacpp_dflash")}
