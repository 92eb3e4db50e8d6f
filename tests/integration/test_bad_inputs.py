"""Bad inputs are stopped at the door: one parametrised test per category of issue 13.

Every case runs the real CLI (`specforge_lite.__main__.main`, in this process: no new
interpreter per case) on the smoke recipe and the tiny random Llama, and checks the exit
status (2), the message, and that nothing was written or lost. One subprocess test proves
the status and the absence of a traceback from a real interpreter.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from specforge_lite.__main__ import main
from tests.conftest import REPO, compose, run_cli
from tests.forked_cli import FRESH_ENV

SMOKE_DATA = REPO / "specforge_lite" / "assets" / "smoke_conversations.jsonl"


def cli(capsys, *args: str) -> tuple[int, str]:
    """Run `python -m specforge_lite ARGS` in this process (in a fresh interpreter where
    tests/forked_cli.py FRESH_ENV says so: a `fresh_cli` test's second run); returns (exit status, stderr)."""
    if os.environ.get(FRESH_ENV) == "1":
        proc = run_cli(*args)
        return proc.returncode, proc.stderr
    code = in_process(*args)
    return code, capsys.readouterr().err


def in_process(*args: str) -> int:
    """`main(ARGS)`'s exit status; the logging handlers Hydra installs for the job (bound to
    this test's captured streams) are taken down after it, as a process exit would."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    for logger in map(logging.getLogger, list(logging.Logger.manager.loggerDict)):
        for handler in logger.handlers:  # libraries' own handlers, made under an earlier test's capture
            if type(handler) is logging.StreamHandler:
                handler.stream = sys.stderr
    try:
        main(list(args))
        return 0
    except SystemExit as done:
        return done.code
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)


def written(run_dir: Path) -> set[str]:
    """Top-level folders a run wrote under run_dir (Hydra's own logs/ aside)."""
    return {p.name for p in run_dir.iterdir() if p.name != "logs"} if run_dir.exists() else set()


def digest(folder: Path) -> dict[str, str]:
    """Content hash of every file under `folder` (logs aside): proves nothing was lost or changed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "logs" not in p.relative_to(folder).parts}


def assert_user_error(code: int, err: str, message: str) -> None:
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in err, err


# --------------------------------------------------------------------------- 1. ranges

RANGE_CASES = [
    ("sample", ["sample.batch_size=0"], "sample.batch_size=0: must be >= 1"),
    ("sample", ["sample.batch_size=-1"], "sample.batch_size=-1: must be >= 1"),
    ("sample", ["sample.shard_size=0"], "sample.shard_size=0: must be >= 1"),
    ("sample", ["sample.max_new_tokens=0"], "sample.max_new_tokens=0: must be >= 1"),
    ("sample", ["data.max_length=0"], "data.max_length=0: must be >= 2"),
    ("sample", ["data.max_samples=-1"], "data.max_samples=-1: must be >= 1"),
    ("sample", ["data.heldout_fraction=1.0"], "data.heldout_fraction=1.0: must be < 1.0"),
    ("sample", ["sample.top_p=0"], "sample.top_p=0.0: must be > 0.0"),
    ("train", ["train.batch_size=-1"], "train.batch_size=-1: must be >= 1"),
    ("train", ["train.lr=0"], "train.lr=0.0: must be > 0.0"),
    ("train", ["train.epochs=0"], "train.epochs=0.0: must be > 0.0"),
    ("train", ["train.max_steps=-5"], "train.max_steps=-5: must be >= 1"),
    ("train", ["train.grad_accum=0"], "train.grad_accum=0: must be >= 1"),
    ("train", ["train.checkpoint_every=-1"], "train.checkpoint_every=-1: must be >= 0 (0 disables)"),
    ("train", ["train.keep_checkpoints=0"], "train.keep_checkpoints=0: must be >= 1"),
    ("train", ["drafter.draft_vocab_size=0"], "drafter.draft_vocab_size=0: must be >= 1"),
    ("train", ["drafter.ttt_steps=0"], "drafter.ttt_steps=0: must be >= 1"),
    ("train", ["drafter.loss=kl"], "Invalid value 'kl', expected one of [forward_kl, reverse_kl, tvd, jsd]"),
    ("train", ["drafter.aux_layer_ids=[1,3]"], "drafter.aux_layer_ids=[1, 3]: needs exactly 3 values, got 2"),
    ("train", ["drafter.aux_layer_ids=[1,3,-1]"], "every value must be >= 0"),
    ("evaluate", ["eval.max_new_tokens=0"], "eval.max_new_tokens=0: must be >= 1"),
    ("evaluate", ["eval.ngram_min=3", "eval.ngram_max=2"], "eval.ngram_min=3 is above eval.ngram_max=2"),
    ("evaluate", ["eval.methods=[plain,eagle4]"], "unknown ['eagle4']"),
    ("evaluate", ["eval.methods=[plain,ngram]", "eval.method_draft_tokens=[ngram:0]"],
     "eval.method_draft_tokens: 'ngram:0' should be METHOD:K"),
    # a stray space is shown (the item's method in quotes), and an empty method list refused
    ("evaluate", ["eval.methods=[plain,ngram]", "eval.best_k_method=ngram", "eval.method_draft_tokens=['ngram :2']"],
     "eval.method_draft_tokens: 'ngram :2': 'ngram ' is not one of eval.methods ['plain', 'ngram']"),
    ("evaluate", ["eval.methods=[]"], "eval.methods=[] lists no method: give at least one"),
    ("run", ["eval.methods=[]"], "eval.methods=[] lists no method"),
    ("sample", ["target.device=tpu"], "target.device='tpu': allowed: auto, cpu, cuda or cuda:N"),
    ("sample", ["sample.rank=2", "sample.world_size=2"], "the rank must be below the world size"),
    ("evaluate", ["eval.vllm.single_process=true", "eval.vllm.tensor_parallel_size=2"],
     "eval.vllm.single_process=true runs one worker: eval.vllm.tensor_parallel_size=2 needs it false"),
    # speedup at load (issue 66): no load of 0, batch 1 always measured, a schedule vLLM takes
    ("evaluate", ["eval.methods=[plain,vllm_ngram]", "eval.concurrency=[0,1]"],
     "eval.concurrency=[0, 1]: every value must be >= 1"),
    ("evaluate", ["eval.methods=[plain,vllm_ngram]", "eval.concurrency=[4,16]"], "eval.concurrency=[4, 16] has no 1"),
    ("evaluate", ["eval.methods=[plain,vllm_ngram]", "eval.concurrency=[1,4]", "eval.load_schedule=[[1,4,1],[3,8,2]]"],
     "vLLM would refuse it: [3, 8, 2] overlaps"),
    ("evaluate", ["eval.concurrency=[1,4]"], "no speculative vllm_* method"),
    ("evaluate", ["eval.temperature=[0,0]"], "eval.temperature=[0, 0] repeats a temperature"),
    ("evaluate", ["eval.temperature=[]"], "eval.temperature=[]: give a temperature"),
    ("evaluate", ["eval.temperature=[0,-1]"], "eval.temperature=[0, -1]: every value must be >= 0.0"),
    # the second pass, against the target's own config (the tiny Llama has 6 layers)
    ("train", ["drafter.aux_layer_ids=[1,3,6]"], "the target has num_hidden_layers=6, so every value must be below 6"),
    ("run", ["drafter.aux_layer_ids=[1,3,60]"], "must be below 6"),
    ("train", ["train.dry_run=true", "drafter.aux_layer_ids=[1,3,6]"], "must be below 6"),
    ("train", ["+recipe=smoke_distilled", "drafter.student=no_such_student"],
     "drafter.student='no_such_student': no such directory"),
    ("train", ["trainer=deepspeed_zero2", "trainer.deepspeed_config=no_such.json"],
     "trainer.deepspeed_config='no_such.json': no such file"),
    ("train", ["+recipe=smoke_distilled", "drafter.student_layers=6"], "drafter.student_layers=6: the target has"),
    ("train", ["+recipe=smoke_medusa", "drafter.num_heads=0"], "drafter.num_heads=0: must be >= 1"),
]


@pytest.mark.parametrize("stage,overrides,message", RANGE_CASES, ids=[" ".join(c[1]) for c in RANGE_CASES])
def test_out_of_range_settings_are_refused_before_anything_runs(capsys, tmp_path, stage, overrides, message):
    recipe = [] if any(o.startswith("+recipe=") for o in overrides) else ["+recipe=smoke"]
    code, err = cli(capsys, stage, *recipe, f"run_dir={tmp_path}", *overrides)
    assert_user_error(code, err, message)
    assert written(tmp_path) == set()


@pytest.mark.fresh_cli
@pytest.mark.parametrize("override,message", [
    ("run_dir={tmp}/${{nope}}", "run_dir='{tmp}/${{nope}}': cannot resolve its value (Interpolation key 'nope' not "
                                "found); write the path out"),
    ("recipe_name=${{nope}}", "run_dir: cannot resolve its value (Interpolation key 'nope' not found)"),
    ("eval.max_new_tokens=${{nope}}", "eval.max_new_tokens: cannot resolve its value (Interpolation key 'nope' not "
                                      "found)\n"),
])
def test_an_interpolation_that_does_not_resolve_is_one_line(capsys, tmp_path, override, message):
    """`${...}` naming no key: in run_dir Hydra resolved it first (its log folder) and printed its
    own traceback; anywhere it is one line naming the key, exit 2, nothing written."""
    run_dir = [] if override.startswith(("run_dir", "recipe_name")) else [f"run_dir={tmp_path}"]
    code, err = cli(capsys, "evaluate", "+recipe=smoke", *run_dir, override.format(tmp=tmp_path))
    assert_user_error(code, err, message.format(tmp=tmp_path))
    assert len(err.strip().splitlines()) == 1, err
    assert not any(tmp_path.iterdir()) if run_dir == [] else written(tmp_path) == set()


@pytest.mark.fresh_cli
def test_a_bad_gemm_rows_environment_setting_is_refused_at_the_door(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_GEMM_ROWS", "eight")
    code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={tmp_path}")
    assert_user_error(code, err, "SPECFORGE_LITE_GEMM_ROWS='eight': expected 0 (inductor's choice) or rows 1..16")
    assert written(tmp_path) == set()


def test_a_bad_autotune_environment_setting_is_refused_at_the_door(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_LITE_AUTOTUNE", "maybe")
    code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={tmp_path}")
    assert_user_error(code, err, "SPECFORGE_LITE_AUTOTUNE='maybe': expected 1 (autotune every product, "
                                 "the default) or 0 (inductor's default kernels)")
    assert written(tmp_path) == set()


def test_every_recipe_passes_validation_and_zero_disables_checkpoints():
    from specforge_lite.stages.door import config_problems

    for recipe in sorted(p.stem for p in (REPO / "conf" / "recipe").glob("*.yaml")):
        assert config_problems(compose([f"+recipe={recipe}"])) == [], recipe
    assert config_problems(compose(["+recipe=smoke", "train.checkpoint_every=0"])) == []


def test_a_user_error_from_a_real_interpreter_is_one_line_and_status_2(tmp_path):
    proc = run_cli("train", "+recipe=smoke", f"run_dir={tmp_path}", "train.batch_size=-1", "+train.lr_typo=1")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0] == "error: 2 invalid settings:" and len(lines) == 3, proc.stderr
    assert written(tmp_path) == set()


# --------------------------------------------------------------------------- 2. +key=value

PLUS_CASES = [
    (["+sample.foo=1"], "sample.foo=1: unknown key (SampleConfig has no such field)"),
    (["+bar=2"], "bar=2: unknown key (Config has no such field)"),
    (["+drafter.x.y=3"], "drafter.x={'y': 3}: unknown key (Eagle3Options has no such field)"),
    (["+train.batchsize=4"], "did you mean train.batch_size?"),
    (["+eval.drafter_dirs.eagle3x=x"], "did you mean eval.drafter_dirs.eagle3?"),
]


@pytest.mark.parametrize("overrides,message", PLUS_CASES, ids=[c[0][0] for c in PLUS_CASES])
def test_plus_keys_outside_the_schema_are_refused(capsys, tmp_path, overrides, message):
    code, err = cli(capsys, "sample", "+recipe=smoke", f"run_dir={tmp_path}", *overrides)
    assert_user_error(code, err, message)
    assert written(tmp_path) == set()


# --------------------------------------------------------------------------- shared runs

def run_ok(*args: str) -> None:
    """The real CLI in this process, for fixtures: it must succeed."""
    code = in_process(*args)
    assert code in (0, None), f"{args} exited with {code}"


def conversation(i: int, prompt: str) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": "Sure."}]}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


SAMPLED = ("data.max_samples=4", "sample.max_new_tokens=4")


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> Path:
    """A smoke run folder with complete samples (4 conversations, 4 new tokens per answer)."""
    run_dir = tmp_path_factory.mktemp("sampled")
    run_ok("sample", "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED)
    return run_dir


# --------------------------------------------------------------------------- 3. empty shards

LONG, SHORT = "Tell me everything about it. " * 12, "Say hi."
EMPTY_SHARD_CASES = [
    # shard 0's prompts are all too long (skipped), shard 1's are fine: train reads past the empty shard
    ("first_shard_empty", [LONG] * 4 + [SHORT] * 4, ["sample.max_new_tokens=16"], 0, "drafter written"),
    ("every_shard_empty", [LONG] * 8, [], 2, "hold no conversations: every prompt was skipped"),
    ("max_new_tokens_0", [SHORT] * 8, ["sample.max_new_tokens=0"], 2, "sample.max_new_tokens=0: must be >= 1"),
]


@pytest.mark.parametrize("name,prompts,overrides,code,message", EMPTY_SHARD_CASES,
                         ids=[c[0] for c in EMPTY_SHARD_CASES])
def test_shards_whose_prompts_were_all_skipped_do_not_break_train(capsys, tmp_path, name, prompts, overrides,
                                                                   code, message):
    source = write_jsonl(tmp_path / "prompts.jsonl", [conversation(i, p) for i, p in enumerate(prompts)])
    run_dir = tmp_path / "run"
    got, err = cli(capsys, "train", "+recipe=smoke", f"run_dir={run_dir}", f"data.source={source}",
                   "data.heldout_fraction=0", "sample.max_prompt_length=100", "sample.max_new_tokens=4",
                   "train.max_steps=1", "train.checkpoint_every=0", *overrides)
    if code == 0:
        assert got == 0, err
        meta = json.loads((run_dir / "samples" / "meta.json").read_text())
        assert meta["num_rows"] == 4 and meta["skipped"] == {"prompt_too_long": 4}
        assert json.loads((run_dir / "train" / "drafter" / "config.json").read_text())["trained_steps"] == 1
    else:
        assert_user_error(got, err, message)
        assert not (run_dir / "train").exists()


# --------------------------------------------------------------------------- 4. readers

GOOD = [conversation(i, f"Question {i}?") for i in range(3)]


def non_utf8_jsonl(path: Path) -> Path:
    lines = [json.dumps(r).encode() for r in GOOD]
    lines[1] = lines[1].replace(b"Question", b"Qu\xff\xfestion")
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def non_utf8_json_array(path: Path) -> Path:
    parts = [json.dumps(r).encode() for r in GOOD]
    parts[1] = parts[1].replace(b"Question", b"Qu\xe9stion")  # Latin-1, not UTF-8
    path.write_bytes(b"[" + b", ".join(parts) + b"]")
    return path


def bad_element_json_array(path: Path) -> Path:
    parts = [json.dumps(r) for r in GOOD]
    parts[1] = parts[1].replace('"Question 1?"}', '"Question 1?",}')  # a trailing comma: invalid JSON
    path.write_text("[" + ", ".join(parts) + "]")
    return path


def eval_turns_string(path: Path) -> Path:
    return write_jsonl(path, [{"id": "a", "turns": ["Hi?", "And?"]}, {"id": "b", "turns": "What is 2+2?"},
                              {"id": "c", "prompt": "Name a colour."}])


READER_CASES = [  # (name, writer, file name, kept ids, skipped reason, strict message)
    ("non_utf8_jsonl", non_utf8_jsonl, "d.jsonl", ["c0", "c2"], "invalid_utf8", "line 2: 2 bytes that are not UTF-8"),
    ("non_utf8_json", non_utf8_json_array, "d.json", ["c0", "c2"], "invalid_utf8",
     "record 1: 1 bytes that are not UTF-8"),
    ("bad_json_element", bad_element_json_array, "d.json", ["c0", "c2"], "invalid_json", "record 1: invalid JSON"),
    ("eval_turns_string", eval_turns_string, "p.jsonl", ["a", "c"], "turns_not_a_list", "record 2: turns_not_a_list"),
]


@pytest.mark.parametrize("name,writer,file_name,kept,reason,strict_message", READER_CASES,
                         ids=[c[0] for c in READER_CASES])
def test_readers_count_what_they_cannot_read_and_keep_the_rest(capsys, tmp_path, name, writer, file_name, kept,
                                                              reason, strict_message):
    from specforge_lite.data.eval_prompts import read_eval_prompts
    from specforge_lite.data.readers import read_conversations

    path = writer(tmp_path / file_name)
    is_eval = name.startswith("eval")
    if is_eval:
        assert [p["id"] for p in read_eval_prompts(str(path))] == kept
        assert [p["turns"] for p in read_eval_prompts(str(path))][0] == ["Hi?", "And?"]
    else:
        records, stats = read_conversations(str(path))
        assert [r["id"] for r in records] == kept and dict(stats.skipped) == {reason: 1}
        assert stats.undecodable_bytes == (2 if name == "non_utf8_jsonl" else 1 if name == "non_utf8_json" else 0)
    # data.strict=true: the first bad record is an error naming the file and the record
    run_dir = tmp_path / "run"
    stage, key = ("evaluate", "eval.dataset") if is_eval else ("sample", "data.source")
    code, err = cli(capsys, stage, "+recipe=smoke", f"run_dir={run_dir}", f"{key}={path}", "data.strict=true")
    assert_user_error(code, err, f"{path}: {strict_message}")
    assert written(run_dir) == set()


# --------------------------------------------------------------------------- 5. stale samples

STALE_CASES = [
    ("data.source", lambda tmp: f"data.source={shutil.copy(SMOKE_DATA, tmp / 'other.jsonl')}"),
    ("sample.max_new_tokens", lambda tmp: "sample.max_new_tokens=5"),
    ("sample.temperature", lambda tmp: "sample.temperature=0.7"),
    ("data.max_length", lambda tmp: "data.max_length=200"),
    ("data.max_samples", lambda tmp: "data.max_samples=3"),
]


@pytest.mark.parametrize("key,override", STALE_CASES, ids=[c[0] for c in STALE_CASES])
def test_train_refuses_samples_made_with_other_settings(capsys, sampled, tmp_path, key, override):
    run_dir = tmp_path / "run"
    shutil.copytree(sampled, run_dir)
    before = digest(run_dir)
    code, err = cli(capsys, "train", "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED, override(tmp_path))
    assert_user_error(code, err, "holds samples made with other settings")
    assert f"{key}=" in err and "delete that folder to sample again" in err
    assert digest(run_dir) == before and not (run_dir / "train").exists()


# --------------------------------------------------------------------------- 8. targets

def tiny_target_copy(tmp: Path) -> Path:
    from specforge_lite.targets.loading import resolve_target_path

    return Path(shutil.copytree(resolve_target_path("builtin:tiny-llama"), tmp / "target"))


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


TARGET_CASES = [  # (name, make(tmp) -> target.path, message)
    ("relative_word", lambda tmp: "no_such_model", "target.path='no_such_model': no such directory"),
    ("relative_under_existing_folder", lambda tmp: "data/no_such_model", "no such directory"),
    ("dot_relative", lambda tmp: "./no_such_model", "no such directory"),
    ("config_truncated", lambda tmp: _damaged(tmp, "config.json", truncate), "config.json: invalid JSON"),
    ("config_missing", lambda tmp: _damaged(tmp, "config.json", Path.unlink), "config.json: missing"),
    ("config_not_object", lambda tmp: _damaged(tmp, "config.json", lambda p: p.write_text("[]")),
     "config.json: expected a JSON object"),
    ("weights_truncated", lambda tmp: _damaged(tmp, "model.safetensors", truncate),
     "model.safetensors: holds"),
    ("weights_missing", lambda tmp: _damaged(tmp, "model.safetensors", Path.unlink), "no weights"),
    ("tokenizer_truncated", lambda tmp: _damaged(tmp, "tokenizer.json", truncate), "tokenizer.json: invalid JSON"),
    ("weight_renamed", lambda tmp: _damaged(tmp, "model.safetensors", _edit_weights(
        lambda w: w.__setitem__("model.norm.renamed", w.pop("model.norm.weight")), folder=False)),
     "its weights do not fit the model (missing model.norm.weight)"),
]


def _damaged(tmp: Path, name: str, damage) -> str:
    target = tiny_target_copy(tmp)
    damage(target / name)
    return str(target)


@pytest.mark.parametrize("name,make,message", TARGET_CASES, ids=[c[0] for c in TARGET_CASES])
def test_bad_target_paths_and_folders_are_named_at_once(capsys, tmp_path, name, make, message):
    run_dir = tmp_path / "run"
    code, err = cli(capsys, "sample", "+recipe=smoke", f"run_dir={run_dir}", f"target.path={make(tmp_path)}")
    assert_user_error(code, err, message)
    assert written(run_dir) == set()


# --------------------------------------------------------------------------- 7. drafter artifacts

CHECKPOINTED = ("train.max_steps=3", "train.checkpoint_every=1", "train.keep_checkpoints=2")


@pytest.fixture(scope="module")
def trained(sampled, tmp_path_factory) -> Path:
    """A finished 3-step smoke training of EAGLE-3 with checkpoints at steps 1 and 2, and a good
    export of its drafter. The drafter is also the reference an interrupted run resumed from
    any checkpoint must end with."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    shutil.copytree(sampled, run_dir)
    run_ok("train", "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED, *CHECKPOINTED)
    run_ok("export", "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED, *CHECKPOINTED)
    assert [p.name for p in (run_dir / "train" / "checkpoints").iterdir()] == ["step-0000001", "step-0000002"]
    return run_dir


def _edit_weights(edit, folder: bool = True):
    """damage(path): rewrite the safetensors file (`path` or the folder's model.safetensors) after `edit`."""
    def damage(path: Path) -> None:
        from safetensors.torch import load_file, save_file

        file = path / "model.safetensors" if folder else path
        weights = load_file(str(file))
        edit(weights)
        save_file(weights, str(file))
    return damage


def _nan(weights):
    weights["fc.weight"][0, 0] = float("nan")


DRAFTER_CASES = [  # (name, damage(train/drafter folder), message)
    ("weights_truncated", lambda d: truncate(d / "model.safetensors"), "model.safetensors: holds"),
    ("tensor_renamed", _edit_weights(lambda w: w.__setitem__("fc_renamed.weight", w.pop("fc.weight"))),
     "model.safetensors: does not fit: missing fc.weight; unexpected fc_renamed.weight"),
    ("tensor_misshapen", _edit_weights(lambda w: w.__setitem__("norm.weight", w["norm.weight"][:7].clone())),
     "model.safetensors: misshapen tensors: norm.weight (7,) (expected (64,))"),
    ("nan_weights", _edit_weights(_nan), "model.safetensors: NaN or inf values in fc.weight"),
    ("config_truncated", lambda d: truncate(d / "config.json"), "config.json: invalid JSON"),
    ("config_not_a_drafter", lambda d: d.joinpath("config.json").write_text('{"drafter": "eagle3"}'),
     "config.json: does not describe a eagle3 drafter"),
]


@pytest.mark.parametrize("stage", ["evaluate", "export"])
@pytest.mark.parametrize("name,damage,message", DRAFTER_CASES, ids=[c[0] for c in DRAFTER_CASES])
def test_damaged_drafter_files_are_named_and_nothing_is_replaced(capsys, trained, tmp_path, stage, name, damage,
                                                                 message):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    damage(run_dir / "train" / "drafter")
    before = digest(run_dir / "export")
    assert json.loads((run_dir / "export" / "export.json").read_text())["strict_reload"] == "passed"
    code, err = cli(capsys, stage, "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED, *CHECKPOINTED,
                    "eval.methods=[plain,eagle3]", "eval.max_prompts=1", "eval.warmup=0")
    assert_user_error(code, err, f"{run_dir / 'train' / 'drafter'}/{message}")
    assert digest(run_dir / "export") == before  # the earlier good export and its export.json stand
    assert not (run_dir / "eval").exists()
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


# --------------------------------------------------------------------------- 6. checkpoints

CHECKPOINT_CASES = [  # (name, files damaged in which checkpoints, exit status, message)
    ("weights_truncated", [("step-0000002", "drafter.safetensors")], 0, "step-0000002/drafter.safetensors: holds"),
    ("optimizer_truncated", [("step-0000002", "optimizer.pt")], 0,
     "step-0000002/optimizer.pt: not a complete torch.save archive"),
    ("rng_truncated", [("step-0000002", "rng.pt")], 0, "step-0000002/rng.pt: not a complete torch.save archive"),
    ("state_truncated", [("step-0000002", "state.json")], 0, "step-0000002/state.json: invalid JSON"),
    ("every_checkpoint_damaged", [("step-0000002", "rng.pt"), ("step-0000001", "drafter.safetensors")], 2,
     "no usable checkpoint in"),
]


@pytest.mark.parametrize("name,damaged,code,message", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(capsys, trained, tmp_path, name,
                                                                        damaged, code, message):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    reference = (run_dir / "train" / "drafter" / "model.safetensors").read_bytes()
    shutil.rmtree(run_dir / "train" / "drafter")  # as if killed after the step-2 checkpoint
    for step, file in damaged:
        truncate(run_dir / "train" / "checkpoints" / step / file)
    got = in_process("train", "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED, *CHECKPOINTED)
    out, err = capsys.readouterr()
    assert message in out + err and "Traceback" not in out + err, out + err
    assert got == code, out + err
    if code == 0:  # resumed from step 1, with a warning, and ended exactly where an uninterrupted run did
        assert "resuming from" in out + err and "step-0000001, an older checkpoint" in out + err
        assert (run_dir / "train" / "drafter" / "model.safetensors").read_bytes() == reference
    else:
        assert not (run_dir / "train" / "drafter").exists()


def test_a_full_disk_leaves_no_temporary_checkpoint_behind(sampled, tmp_path):
    """Writes past a file-size limit fail as on a full disk (EFBIG instead of ENOSPC)."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    shutil.copytree(sampled, run_dir)
    limit = 64 * 1024  # above every sample and log file, below a checkpoint's optimizer state
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
              "from specforge_lite.__main__ import main; main(sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", script, "train", "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED,
                           *CHECKPOINTED], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert "error: cannot write checkpoint" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    checkpoints = run_dir / "train" / "checkpoints"
    assert list(checkpoints.iterdir()) == [] and not (run_dir / "train" / "drafter").exists()


def _medusa_folder(tiny_target, folder: Path) -> Path:
    from omegaconf import OmegaConf

    from specforge_lite.drafters import medusa

    model, _ = tiny_target
    cfg = OmegaConf.create({"drafter": {"num_heads": 2, "num_layers": 1, "draft_vocab_size": 64},
                            "train": {"seed": 0}})
    medusa.save(medusa.build(cfg, model, torch_arange(model.config.vocab_size)), folder)
    return folder


def _distilled_folder(tiny_target, folder: Path) -> Path:
    from specforge_lite.targets.surgery import truncated_copy

    model, _ = tiny_target
    truncated_copy(model, 2).save_pretrained(folder)
    (folder / "drafter.json").write_text(json.dumps({"drafter": "distilled"}))
    return folder


def torch_arange(n: int):
    import torch

    return torch.arange(n).flip(0)


OTHER_DRAFTER_CASES = [  # the Medusa and distilled loaders, behind evaluate and export, on the same damage
    ("medusa", "weights_truncated", lambda d: truncate(d / "model.safetensors"), "model.safetensors: holds"),
    ("medusa", "tensor_renamed", _edit_weights(lambda w: w.__setitem__("renamed", w.pop("blocks.0.layers.0.weight"))),
     "model.safetensors: does not fit: missing blocks.0.layers.0.weight; unexpected renamed"),
    ("medusa", "config_truncated", lambda d: truncate(d / "config.json"), "config.json: invalid JSON"),
    ("medusa", "nan_weights", _edit_weights(lambda w: w["blocks.0.layers.0.weight"].fill_(float("nan"))),
     "NaN or inf values in blocks.0.layers.0.weight"),
    ("distilled", "weights_truncated", lambda d: truncate(d / "model.safetensors"), "model.safetensors: holds"),
    ("distilled", "tensor_renamed", _edit_weights(lambda w: w.__setitem__("renamed", w.pop("model.norm.weight"))),
     "missing model.norm.weight; unexpected renamed"),
    ("distilled", "config_truncated", lambda d: truncate(d / "config.json"), "config.json: invalid JSON"),
    ("distilled", "nan_weights", _edit_weights(lambda w: w["model.norm.weight"].fill_(float("nan"))),
     "NaN or inf values in model.norm.weight"),
]


@pytest.mark.parametrize("kind,name,damage,message", OTHER_DRAFTER_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in OTHER_DRAFTER_CASES])
def test_damaged_medusa_and_distilled_folders_are_named(tiny_target, tmp_path, kind, name, damage, message):
    from specforge_lite import SpecforgeError
    from specforge_lite.drafters import distilled as distill
    from specforge_lite.drafters import medusa

    make, load = {"medusa": (_medusa_folder, medusa.load), "distilled": (_distilled_folder, distill.load)}[kind]
    folder = make(tiny_target, tmp_path / "drafter")
    load(folder, tiny_target[0])  # intact: loads
    damage(folder)
    with pytest.raises(SpecforgeError, match="(?s)" + re.escape(message)):
        load(folder, tiny_target[0])
