"""Targets of other families (tests/families.py: Qwen3, Qwen3-MoE, gpt-oss, Mistral with its
window, Gemma 3, DeepSeek-V3, Llama 4, Gemma 4's KV sharing) through the stages, and what the door
refuses for them (Qwen3-Next's and Falcon-H1's recurrent layers; issues 53 and 65).

A family is one entry of `FAMILIES`; each test here is parametrised over them (EAGLE-3 through
every stage, DFlash through every stage, the cache rolled back). Evaluate runs the families of
`STATIC_FAMILIES` on our static forward and the others on transformers', whose cache the runner
keeps whole for sliding-window and chunked layers (runtime/hf_runner.py `rollback_cache`).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_cli
from tests.families import FAMILIES, REFUSED_FAMILIES, SHARED_KV_FAMILIES, STATIC_FAMILIES, WINDOW
from tests.families import family_target  # noqa: F401  (a fixture)
from tests.integration.test_bad_inputs import assert_user_error, cli, written

# every stage at its smallest: a few conversations, a few steps, one held-out prompt timed once
SMALL = ["data.max_samples=4", "sample.max_new_tokens=8", "train.max_steps=2", "train.checkpoint_every=0",
         "eval.warmup=0", "eval.cost_repeats=1", "eval.plots=false", "eval.bootstrap.resamples=100"]
# smoke's methods (untrained_draft: the target's first layers, sliding ones included), plus a tree,
# whose verify forward takes per-layer-type masks
METHODS = "eval.methods=[plain,eagle3,eagle3_tree,ngram,untrained_draft,hf_generate,hf_prompt_lookup,hf_assisted]"


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """The CLI runs one torch thread: these products are too small to share, and two threads
    spinning beside the rest of the suite made every stage several times slower."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_stage_runs_each_family_on_its_forward(family, family_target, tmp_path, record_property):
    """Every stage on each family: on our static forward where it covers the family
    (tests/unit/test_static_families.py compares it and the compiled one with transformers'),
    else on transformers' forward, which eval.engine=auto falls back to with the reason."""
    run_dir = tmp_path / "run"
    static = family in STATIC_FAMILIES
    run_cli("run", "+recipe=smoke", f"target.path={family_target(family)}", f"run_dir={run_dir}",
            "eval.engine=static" if static else "eval.engine=auto", METHODS, *SMALL, check=True)
    assert json.loads((run_dir / "samples" / "meta.json").read_text())["complete"] is True
    assert (run_dir / "train" / "drafter" / "model.safetensors").exists()
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    engine = report["settings"]["engine"]
    record_property("engine", engine["used"])  # for the family table (python -m specforge_lite families)
    record_property("fallback", engine.get("fallback") or "")
    if static:
        assert engine["used"] == "static", engine
    else:
        assert engine["used"] == "hf" and "the static forward does not support" in engine["fallback"], engine
    assert set(report["methods"]) == set(METHODS.split("[")[1].rstrip("]").split(","))
    assert {m: e["identical_to_plain"] for m, e in report["methods"].items()} == \
        {m: True for m in report["methods"]}, report["methods"]
    export = json.loads((run_dir / "export" / "export.json").read_text())
    assert export["drafter"] == "eagle3" and export["strict_reload"] == "passed", export


@pytest.mark.parametrize("family", FAMILIES)
def test_dflash_runs_every_stage_on_each_family(family, family_target, tmp_path):
    """DFlash reads other target layers than EAGLE-3 (its aux layers from the target's depth) and
    drafts a block in one forward: sample, train, evaluate (identical to plain) and export on each."""
    run_dir = tmp_path / "run"
    run_cli("run", "+recipe=smoke_dflash", f"target.path={family_target(family)}", f"run_dir={run_dir}",
            "eval.engine=static" if family in STATIC_FAMILIES else "eval.engine=auto", "eval.methods=[plain,dflash]",
            "eval.max_prompts=2", *SMALL, check=True)
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert {m: e["identical_to_plain"] for m, e in report["methods"].items()} == {"plain": True, "dflash": True}
    export = json.loads((run_dir / "export" / "export.json").read_text())
    assert export["drafter"] == "dflash" and export["strict_reload"] == "passed", export


@pytest.mark.parametrize("family", SHARED_KV_FAMILIES)
def test_a_kv_sharing_family_drafts_as_plain_decodes(family, family_target, tmp_path):
    """Layers that reuse earlier layers' keys and values hold no cache of their own (transformers'
    DummyLayer): the door lets drafting through, and every rejected draft is cropped losslessly."""
    run_dir = tmp_path / "run"
    methods = "eval.methods=[plain,eagle3,eagle3_tree,ngram,hf_generate,hf_prompt_lookup]"
    run_cli("run", "+recipe=smoke", f"target.path={family_target(family)}", f"run_dir={run_dir}",
            "eval.engine=auto", methods, "eval.max_prompts=2", *SMALL, check=True)
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert {m: e["identical_to_plain"] for m, e in report["methods"].items()} == \
        {m: True for m in methods.split("[")[1].rstrip("]").split(",")}, report["methods"]
    assert report["methods"]["ngram"]["acceptance_rate"] < 1, "no draft was rejected, so none was cropped"


@pytest.mark.parametrize("family", [*FAMILIES, *SHARED_KV_FAMILIES])
def test_the_runner_rolls_back_chains_and_trees_past_the_window(family, family_target):
    """Drafts rejected after the context outgrew the sliding window, a tree verify and the path
    it keeps: every logit as the whole sequence's forward gives it (the cache and the tree's
    masks keep each layer's window; transformers' own sliding cache could not be cropped)."""
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from specforge_lite.runtime.hf_runner import TargetRunner, attention_chunks, sliding_windows

    model = AutoModelForCausalLM.from_pretrained(family_target(family), dtype=torch.float32).eval()
    windowed = any(isinstance(layer, DynamicSlidingWindowLayer) for layer in DynamicCache(config=model.config).layers)
    # the families with a window (or chunks) are the ones tested for it
    assert windowed == bool(sliding_windows(model.config) or attention_chunks(model.config))
    ids = torch.randint(0, 256, (3 * WINDOW,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        whole = model(torch.tensor([ids])).logits[0]
        runner = TargetRunner(model, [1])
        runner.reset()
        n = WINDOW // 2
        logits, _ = runner.forward(ids[:n])
        seen = [(logits, whole[:n])]
        while n < 2 * WINDOW:  # the right token and two wrong drafts, cropped back
            logits, _ = runner.forward([ids[n], 300, 301])
            seen.append((logits[:1], whole[n:n + 1]))
            runner.crop(n + 1)
            n += 1
        # rows: 0 = the right token, 1 = a wrong sibling, 2 = the right child of row 0
        base = runner.length
        mask = torch.zeros(3, base + 3, dtype=torch.bool)
        mask[:, :base] = True
        mask[0, base] = mask[1, base + 1] = mask[2, base] = mask[2, base + 2] = True
        logits, _ = runner.forward_tree([ids[n], 299, ids[n + 1]], torch.tensor([n, n, n + 1]), mask)
        seen += [(logits[0], whole[n]), (logits[2], whole[n + 1])]
        runner.keep_rows(base, [0, 2])
        logits, _ = runner.forward(ids[n + 2:n + 4])
        seen.append((logits, whole[n + 2:n + 4]))
    assert max(float((a - b).abs().max()) for a, b in seen) < 1e-4


# --------------------------------------------------------------------------- the door

def test_a_family_without_the_static_forward_asked_for_it_is_one_line_before_any_work(family_target, tmp_path):
    """The issue's own run (on Qwen3-MoE then; the static forward covers it now): a real
    interpreter, the smoke recipe (eval.engine=static) on gpt-oss."""
    target = family_target("gpt_oss")
    proc = run_cli("run", "+recipe=smoke", f"target.path={target}", f"run_dir={tmp_path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: invalid setting: eval.engine=static: the static forward does not support model_type "
                     "'gpt_oss' (the static forward covers llama, mistral, qwen2, qwen3, qwen3_moe); eval.engine=hf "
                     "runs this target on transformers' forward (auto chooses it)"], proc.stderr
    assert written(tmp_path) == set()


DOOR_CASES = [
    ("gpt_oss", ["evaluate", "eval.engine=compiled", "eval.methods=[plain,eagle3]"],
     "eval.engine=compiled: the static forward does not support model_type 'gpt_oss'"),
    # a window on every layer (Mistral's) runs on the static forward; a window on some layers only does not
    ("qwen3+some_layers_sliding", ["run", "eval.engine=static", "eval.methods=[plain,eagle3]"],
     "eval.engine=static: the static forward does not support model_type 'qwen3' with sliding-window layers "
     "beside full-attention ones"),
    # sample and train would run; evaluate's drafts could not be taken back out of the cache
    ("qwen3_next", ["run", "eval.engine=hf", "eval.methods=[plain,hf_generate,eagle3,ngram]"],
     "eval.methods=['eagle3', 'ngram']: model_type 'qwen3_next' cannot run them on our decoder: its cache layers "
     "['LinearAttentionLayer'] keep a recurrent state"),
    # its hybrid layers are attention layers to transformers' cache, which also keep a Mamba state
    ("falcon_h1", ["run", "eval.engine=hf", "eval.methods=[plain,eagle3,ngram]"],
     "eval.methods=['eagle3', 'ngram']: model_type 'falcon_h1' cannot run them on our decoder: its cache layers "
     "['LinearAttentionAndFullAttentionLayer'] keep a recurrent state"),
]


@pytest.mark.parametrize("family,args,message", DOOR_CASES, ids=[c[0] for c in DOOR_CASES])
def test_what_a_family_cannot_run_is_refused_at_the_door(capsys, family_target, tmp_path, family, args, message,
                                                        record_property):
    import json
    import shutil

    stage, *overrides = args
    target = family_target(family.split("+")[0])
    if family.endswith("+some_layers_sliding"):  # the family's folder with full-attention layers among sliding ones
        target = shutil.copytree(target, tmp_path.with_name(tmp_path.name + "_target"))
        config = json.loads((target / "config.json").read_text())
        layers = config["num_hidden_layers"]
        config.update(use_sliding_window=True, sliding_window=16, max_window_layers=layers - 1,
                      layer_types=["full_attention"] * (layers - 1) + ["sliding_attention"])
        (target / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # building the folder (when this test is the first to ask) prints its progress
    code, err = cli(capsys, stage, "+recipe=smoke", f"target.path={target}", f"run_dir={tmp_path}", *overrides)
    assert_user_error(code, err, message)
    assert len(err.strip().splitlines()) == 1, err
    assert written(tmp_path) == set()
    if family in REFUSED_FAMILIES:  # for the family table (python -m specforge_lite families)
        record_property("refused", err.strip().split(": ", 2)[-1])


def _retyped(source, folder, auto_map: bool):
    """A copy of a family's folder whose model_type transformers does not know, with or without
    code of its own (config.json `auto_map`; the code would fail if it ever ran)."""
    import shutil

    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "tiny_custom"
    if auto_map:
        config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig",
                              "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
        (folder / "configuration_custom.py").write_text("raise RuntimeError('remote code ran')\n")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("auto_map,message", [
    (True, "model_type 'tiny_custom' is defined by code in the folder (config.json auto_map), not by transformers"),
    (False, "does not know model_type 'tiny_custom' and the folder has no code for it"),
], ids=["remote_code", "unknown"])
def test_a_model_type_that_needs_remote_code_is_refused_unless_allowed(capsys, family_target, tmp_path, auto_map,
                                                                       message):
    from specforge_lite.targets.model_types import check_model_type
    from tests.conftest import target_cfg

    folder = _retyped(family_target("qwen3"), tmp_path / "custom", auto_map)
    capsys.readouterr()  # building the folder (when this test is the first to ask) prints its progress
    run_dir = tmp_path / "run"
    code, err = cli(capsys, "sample", "+recipe=smoke", f"target.path={folder}", f"run_dir={run_dir}")
    assert_user_error(code, err, message)
    assert len(err.strip().splitlines()) == 1, err
    assert written(run_dir) == set()
    if auto_map:  # allowed, the door lets transformers run the folder's code
        check_model_type(folder, target_cfg(str(folder), trust_remote_code=True))
    # a model_type transformers knows keeps its own class, whatever auto_map says
    known = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**known, "model_type": "qwen3"}))
    check_model_type(folder, target_cfg(str(folder)))


# --------------------------------------------------------------------------- what a target the door refuses runs

def test_a_target_that_cannot_roll_back_evaluates_what_it_can(family_target, tmp_path):
    """The door's own advice for Qwen3-Next (eval.methods=[plain,hf_generate]; issue 65): evaluate
    measures both, and the forward's cost curve, timed by cropping the cache back after each
    forward, is timed at t=1 only, each forward after a prefill anew, and the report says why."""
    run_dir = tmp_path / "run"
    run_cli("evaluate", "+recipe=smoke", f"target.path={family_target('qwen3_next')}", f"run_dir={run_dir}",
            "eval.engine=hf", "target.dtype=auto", "eval.methods=[plain,hf_generate]", "eval.best_k_method=null",
            "eval.max_prompts=1", "eval.max_new_tokens=4", "eval.warmup=0", "eval.plots=false", "eval.cost_repeats=1",
            check=True)
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert {m: e["identical_to_plain"] for m, e in report["methods"].items()} == {"plain": True, "hf_generate": True}
    costs = report["forward_costs"]
    assert list(costs["ms_by_num_tokens"]) == ["1"], costs
    assert costs["note"].startswith("timed at t=1 only: its cache layers ['LinearAttentionLayer'] keep a recurrent "
                                    "state"), costs
    assert costs["note"] in (run_dir / "eval" / "report.md").read_text()


@pytest.mark.parametrize("family", REFUSED_FAMILIES)
def test_a_recurrent_target_samples_in_batches_as_it_does_alone(family, family_target, tmp_path):
    """Qwen3-Next and Falcon-H1 sampled two at a time (issue 65): a row that finishes leaves the
    batch with its recurrent state (transformers' own row selection has none for Qwen3-Next's layer,
    and keeps every row of a hybrid layer's), and the left padding leaves every answer as the
    target gives it alone."""
    import pyarrow.parquet as pq

    rows = {}
    for batch in (1, 2):
        run_dir = tmp_path / f"batch{batch}"
        run_cli("sample", "+recipe=smoke", f"target.path={family_target(family)}", f"run_dir={run_dir}",
                f"sample.batch_size={batch}", check=True)
        rows[batch] = [row for shard in sorted((run_dir / "samples" / "data").glob("*.parquet"))
                       for row in pq.read_table(shard).to_pylist()]
    # some rows ended early while the other row of their batch decoded on
    assert {reason for row in rows[2] for reason in row["finish_reasons"]} == {"stop", "length"}
    assert rows[2] == rows[1]


def test_layer_types_that_disagree_with_the_depth_are_one_line(capsys, family_target, tmp_path):
    """A config.json whose layer_types lists another number of layers than num_hidden_layers (issue
    65): refused at the door of every stage, the file and both lengths named, nothing written."""
    import shutil

    target = shutil.copytree(family_target("gemma3_text"), tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "layer_types": config["layer_types"][:4]}))
    capsys.readouterr()  # building the folder (when this test is the first to ask) prints its progress
    run_dir = tmp_path / "run"
    for stage, *overrides in (("sample",), ("evaluate", "eval.engine=hf"), ("train", "train.dry_run=true")):
        code, err = cli(capsys, stage, "+recipe=smoke", f"target.path={target}", f"run_dir={run_dir}", *overrides)
        assert_user_error(code, err, f"{target / 'config.json'} lists 4 layer_types for num_hidden_layers="
                                     f"{config['num_hidden_layers']}; give one layer type per layer")
        assert len(err.strip().splitlines()) == 1, err
    assert written(run_dir) == set()
