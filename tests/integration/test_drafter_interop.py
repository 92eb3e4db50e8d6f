"""Drafters users already have, through the real CLI on the smoke target: evaluate reads a
speculators export and an SGLang folder as `eval.drafter_dirs.eagle3`, training starts from
one (`drafter.init_from`), and export converts one (`export.drafter_dir`). The first run's
evaluate also takes the EAGLE-3 hybrids (chain and tree) through the stage."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
def test_evaluate_train_and_export_take_foreign_layouts(tmp_path):
    base = ["+recipe=smoke", f"samples_dir={tmp_path / 'samples'}", "drafter.norm_before_residual=false"]
    first = tmp_path / "first"
    run_cli("run", *base, f"run_dir={first}", "train.max_steps=3", "export.sglang=true",
            "eval.methods=[plain,eagle3,eagle3_hybrid,eagle3_hybrid_tree]", "eval.max_prompts=1", check=True)
    # the hybrids through the stage: lossless, each step's source counted in the report
    methods = json.loads((first / "eval" / "report.json").read_text())["methods"]
    for name in ("eagle3_hybrid", "eagle3_hybrid_tree"):
        sources = methods[name]["sources"]
        assert methods[name]["identical_to_plain"] is True and sum(s["steps"] for s in sources.values()) > 0
    assert methods["eagle3_hybrid_tree"]["tree"]["chain"] == "eagle3_hybrid" and "best_k" in methods["eagle3_hybrid"]
    speculators, sglang = first / "export" / "speculators", first / "export" / "sglang"
    # the export's README says what evaluate recommends (a hybrid: ours only, and what an engine serves)
    deploy = json.loads((first / "eval" / "report.json").read_text())["recommendation"]["deploy"]
    assert f"recommends **{deploy}**" in (speculators / "README.md").read_text()
    for folder, layout in ((speculators, "speculators"), (sglang, "sglang")):
        run_dir = tmp_path / f"eval_{layout}"
        proc = run_cli("evaluate", *base, f"run_dir={run_dir}", f"eval.drafter_dirs.eagle3={folder}",
                       "eval.methods=[plain,eagle3]", "eval.max_prompts=2", check=True)
        assert f"({layout} layout)" in proc.stdout + proc.stderr
        report = json.loads((run_dir / "eval" / "report.json").read_text())
        assert report["methods"]["eagle3"]["identical_to_plain"] is True
    # the same prompts give the same acceptance whichever layout the drafter was read from
    taus = [json.loads((tmp_path / f"eval_{x}" / "eval" / "report.json").read_text())["methods"]["eagle3"]["tau"]
            for x in ("speculators", "sglang")]
    assert taus[0] == taus[1]
    # several drafters side by side in one report, under labels of the user's
    both = tmp_path / "both"
    run_cli("evaluate", *base, f"run_dir={both}", "eval.methods=[plain]", "eval.max_prompts=2",
            f"eval.extra_drafters=[ours:{first / 'train' / 'drafter'},as_sglang:{sglang}]", "eval.best_k_method=ours",
            check=True)
    methods = json.loads((both / "eval" / "report.json").read_text())["methods"]
    assert list(methods) == ["plain", "ours", "as_sglang"] and methods["ours"]["tau"] == methods["as_sglang"]["tau"]
    warm = tmp_path / "warm"
    proc = run_cli("train", *base, f"run_dir={warm}", f"drafter.init_from={sglang}", "train.max_steps=2",
                   check=True)
    assert (warm / "train" / "drafter" / "model.safetensors").exists()
    converted = tmp_path / "converted"
    proc = run_cli("export", *base, f"run_dir={converted}", f"export.drafter_dir={sglang}", check=True)
    assert "(sglang layout)" in proc.stdout + proc.stderr
    assert json.loads((converted / "export" / "export.json").read_text())["strict_reload"] == "passed"
    # a folder that is no drafter is named in a one-line error
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{}")
    proc = run_cli("evaluate", *base, f"run_dir={tmp_path / 'bad'}", f"eval.drafter_dirs.eagle3={tmp_path / 'junk'}",
                   "eval.methods=[plain,eagle3]")
    assert proc.returncode == 2 and "junk/config.json is no drafter layout we read" in proc.stderr
    assert "Traceback" not in proc.stderr
