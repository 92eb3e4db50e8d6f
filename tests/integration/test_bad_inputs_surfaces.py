"""The surfaces added after the bad-input door (issue 31), held to its standard.

Each class of the issue, tried as a new user would: a failed run overwriting the record of
a good one, artifacts another user cannot read, a folder the user named or set that cannot
be written, checks that depend only on the config and the installed packages done late or
never, and build folders a killed compile leaves behind. Every case runs the real CLI in
this process on the smoke recipe and the tiny random Llama (`tests/integration/
test_bad_inputs.py` has the helpers), or the real graph cache on a toy module.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_bad_inputs import (
    SAMPLED,
    assert_user_error,
    cli,
    digest,
    in_process,
    run_ok,
    write_jsonl,
    written,
)

QUICK_EVAL = ("eval.methods=[plain]", "eval.max_prompts=2", "eval.warmup=0", "eval.max_new_tokens=4",
              "eval.plots=false", "eval.best_k_method=null")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A smoke run folder sampled, trained (1 step, after a checkpoint of another run's first
    step), evaluated and exported under umask 022."""
    run_dir = tmp_path_factory.mktemp("surfaces") / "run"
    mask = os.umask(0o022)
    try:
        run_ok("sample", "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED)
        run_ok("train", "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED, "train.max_steps=2", "train.checkpoint_every=1")
        restart = ("train.resume=false", "train.checkpoint_every=1", "train.max_steps=3")  # other settings, same steps
        for stage, extra in (("train", restart), ("evaluate", QUICK_EVAL), ("export", ())):
            run_ok(stage, "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED, "train.max_steps=1",
                   "train.checkpoint_every=0", *extra)
        assert list((run_dir / "train" / "checkpoints").iterdir())  # one kept: its modes are checked too
    finally:
        os.umask(mask)
    return run_dir


# --------------------------------------------------------------------------- 2. provenance

@pytest.mark.parametrize("recipe,key", [("smoke", "drafter.init_from"), ("smoke_peagle", "drafter.init_from_eagle3"),
                                        ("smoke_distilled", "drafter.student")])
def test_a_refused_train_leaves_the_earlier_drafter_and_its_record_as_they_were(capsys, exported, tmp_path, recipe,
                                                                                 key):
    not_a_drafter = tmp_path / "empty"  # a folder (it passes the door's path check), but no drafter or model
    not_a_drafter.mkdir()
    before = digest(exported / "train")
    code, err = cli(capsys, "train", f"+recipe={recipe}", f"run_dir={exported}", *SAMPLED, "train.max_steps=1",
                    "train.checkpoint_every=0", f"{key}={not_a_drafter}")
    assert code == 2 and "Traceback" not in err, err
    assert str(not_a_drafter) in err, err
    assert digest(exported / "train") == before  # config.yaml, versions.json and the drafter, byte for byte


def test_a_train_that_starts_over_sets_the_old_checkpoints_aside_and_resumes_its_own(capsys, exported, tmp_path):
    """`train.resume=false` (max_steps=3) after a run of other settings that checkpointed step 1: the
    old checkpoint is moved aside and the new run's steps 1 and 2 are its own (it used to keep the
    old step 1, and a resume from it then blamed settings)."""
    checkpoints, aside = exported / "train" / "checkpoints", exported / "train" / "checkpoints.previous"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-0000001", "step-0000002"]
    assert sorted(p.name for p in aside.iterdir()) == ["step-0000001"]
    stamp = {p.name: json.loads((p / "state.json").read_text())["fingerprint"] for p in checkpoints.iterdir()}
    assert stamp["step-0000001"] == stamp["step-0000002"]  # both of this run
    assert json.loads((aside / "step-0000001" / "state.json").read_text())["fingerprint"] != stamp["step-0000001"]
    run_dir = tmp_path / "run"
    shutil.copytree(exported, run_dir)
    shutil.rmtree(run_dir / "train" / "drafter")  # so that the same settings train (resume) again
    code, err = cli(capsys, "train", "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED, "train.max_steps=3",
                    "train.checkpoint_every=1")
    assert code in (0, None), err
    assert re.search(r"train:\s+67%\|[^|]*\| 2/3 ", err), err  # its bar starts at step 2 of 3: resumed, not refused
    assert (run_dir / "train" / "drafter").is_dir()


def test_the_drafter_folder_carries_its_own_provenance(exported):
    drafter = exported / "train" / "drafter"
    assert (drafter / "config.yaml").read_bytes() == (exported / "train" / "config.yaml").read_bytes()
    assert "train:" in (drafter / "config.yaml").read_text()
    assert json.loads((drafter / "versions.json").read_text())["torch"]


def test_sampling_again_with_another_backend_does_not_rename_who_made_the_samples(capsys, exported):
    samples = exported / "samples"
    before = digest(samples)
    assert json.loads((samples / "meta.json").read_text())["sampling"]["backend"] == "hf"
    code, err = cli(capsys, "sample", "+recipe=smoke", f"run_dir={exported}", *SAMPLED, "sample.backend=static")
    assert code in (0, None), err
    assert digest(samples) == before
    meta = json.loads((samples / "meta.json").read_text())
    assert meta["sampling"]["backend"] == "hf" and meta["shard_backends"] == {"hf": 1}


# --------------------------------------------------------------------------- 3. modes

def test_every_artifact_is_readable_by_others_under_umask_022(exported):
    unreadable = []
    for path in [exported, *exported.rglob("*")]:
        if "logs" in path.relative_to(exported).parts:
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        wanted = 0o755 if path.is_dir() else 0o644
        if mode & 0o055 != wanted & 0o055:
            unreadable.append(f"{path.relative_to(exported)} {oct(mode)}")
    assert not unreadable, unreadable
    for folder in ("export", "train/drafter", "train/checkpoints", "eval", "samples"):  # each checked above
        assert (exported / folder).is_dir() and any((exported / folder).iterdir())


# --------------------------------------------------------------------------- 4. folders the user named or set

def test_a_run_dir_that_is_a_file_is_named_before_hydra_writes_its_logs(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for run_dir, message in ((afile, f"run_dir: {afile} is a file, not a folder"),
                             (afile / "run", f"run_dir: {afile / 'run'} cannot be created: {afile} is a file")):
        code, err = cli(capsys, "sample", "+recipe=smoke", f"run_dir={run_dir}")
        assert_user_error(code, err, message)
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("stage,folder", [("train", "train"), ("evaluate", "eval"), ("export", "export"),
                                          ("sample", "samples"), ("run", "eval")])
def test_a_file_where_a_stage_folder_goes_is_refused_at_the_door(capsys, tmp_path, stage, folder):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / folder).write_text("mine")
    code, err = cli(capsys, stage, "+recipe=smoke", f"run_dir={run_dir}")
    assert_user_error(code, err, f"run_dir: {run_dir / folder} is a file, not a folder")
    assert written(run_dir) == {folder} and (run_dir / folder).read_text() == "mine"
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".")]  # nothing renamed aside and hidden


CACHE_CASES = [  # (name, value(tmp), message)
    ("empty", lambda tmp: "", "SPECFORGE_LITE_CACHE is set but empty"),
    ("blank", lambda tmp: "  ", "SPECFORGE_LITE_CACHE is set but empty"),
    ("a_file", lambda tmp: str(_file(tmp)), "SPECFORGE_LITE_CACHE: {tmp}/afile is a file, not a folder"),
    ("under_a_file", lambda tmp: str(_file(tmp) / "cache"),
     "SPECFORGE_LITE_CACHE: {tmp}/afile/cache cannot be created: {tmp}/afile is a file"),
]


def _file(tmp: Path) -> Path:
    (tmp / "afile").write_text("mine")
    return tmp / "afile"


@pytest.mark.parametrize("name,value,message", CACHE_CASES, ids=[c[0] for c in CACHE_CASES])
def test_a_bad_model_cache_setting_is_named_at_the_door(capsys, tmp_path, monkeypatch, name, value, message):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # an empty setting must not build models here
    monkeypatch.setenv("SPECFORGE_LITE_CACHE", value(tmp_path))
    run_dir = tmp_path / "run"
    code, err = cli(capsys, "sample", "+recipe=smoke", f"run_dir={run_dir}")
    assert_user_error(code, err, message.format(tmp=tmp_path))
    assert written(run_dir) == set() and list(work.iterdir()) == []


def test_an_os_error_under_run_dir_mid_stage_is_one_line_naming_it(capsys, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "samples" / "split.json").mkdir(parents=True)  # a folder where the stage writes a file
    code, err = cli(capsys, "sample", "+recipe=smoke", f"run_dir={run_dir}", *SAMPLED)
    assert_user_error(code, err, f"run_dir={run_dir}: cannot write")
    assert "split.json" in err and len([line for line in err.splitlines() if line.startswith("error:")]) == 1


class _Toy:
    @staticmethod
    def module():
        import torch

        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()


def test_a_graph_folder_that_cannot_hold_a_package_is_said_before_compiling(tmp_path):
    from specforge_lite.runtime import graph_cache

    package = tmp_path / "toy-abc.pt2"
    package.mkdir()  # a folder where the package file goes
    assert graph_cache._unkeepable(tmp_path, package) == f"{package} is not a file"
    (tmp_path / "file").write_text("mine")
    under_a_file = tmp_path / "file" / "graphs"
    assert graph_cache._unkeepable(under_a_file, under_a_file / "x.pt2") == f"{under_a_file}: Not a directory"
    assert graph_cache._unkeepable(tmp_path / "new" / "graphs", tmp_path / "new" / "graphs" / "x.pt2") is None
    assert sorted(p.name for p in (tmp_path / "new" / "graphs").iterdir()) == []  # the probe file is gone


def test_a_graph_that_cannot_be_kept_is_used_for_the_run_with_a_warning(tmp_path, caplog, monkeypatch):
    """The graph folder is a file: the graph is compiled in a scratch folder, used, and said so.
    Its build folders in TMPDIR carry the process id (what the next run's cleanup reads)."""
    import tempfile

    import torch

    from specforge_lite.runtime import graph_cache

    prefixes, real = [], tempfile.TemporaryDirectory

    def spy(*args, **kwargs):
        prefixes.append(kwargs.get("prefix", ""))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryDirectory", spy)
    afile = tmp_path / "graphs"
    afile.write_text("mine")
    module, x = _Toy.module(), torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger=graph_cache.__name__):
        graph, _, how = graph_cache.compile_kept("toy", module, [(x,)], cache_dir=afile)
    assert how == "compiled" and afile.read_text() == "mine" and list(tmp_path.iterdir()) == [afile]
    with torch.inference_mode():
        torch.testing.assert_close(graph(x), module(x))
    assert f"cannot keep compiled graphs in {afile} (SPECFORGE_LITE_GRAPH_CACHE" in caplog.text
    assert "for this run only" in caplog.text
    ours = [p for p in prefixes if p.startswith("specforge_lite_")]
    assert {p.rsplit("_", 2)[0] for p in ours} == {"specforge_lite_build", "specforge_lite_graph"}, prefixes
    assert all(p.endswith(f"_{os.getpid()}_") for p in ours), prefixes


# --------------------------------------------------------------------------- 5. config and packages, at the door

def test_vllm_methods_without_vllm_are_refused_before_the_evaluation(capsys, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "eval").mkdir(parents=True)
    (run_dir / "eval" / "report.json").write_text('{"earlier": true}\n')
    missing = tmp_path / "no-venv" / "bin" / "python"
    code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={run_dir}", "eval.methods=[plain,vllm_plain]",
                    f"eval.vllm.python={missing}", "eval.best_k_method=null")
    assert_user_error(code, err, f"eval.methods ['vllm_plain']: the vLLM interpreter {missing} does not exist")
    assert (run_dir / "eval" / "report.json").read_text() == '{"earlier": true}\n'
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == ["report.json"]


@pytest.mark.parametrize("kind,config", [
    ("peagle", {"drafter": "peagle"}), ("medusa", {"drafter": "medusa"}),
    ("distilled", {"architectures": ["LlamaForCausalLM"]})])
def test_export_sglang_for_a_drafter_sglang_cannot_hold_is_refused(capsys, tmp_path, kind, config):
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "run"
    code, err = cli(capsys, "export", "+recipe=smoke", f"run_dir={run_dir}", f"export.drafter_dir={folder}",
                    "export.sglang=true")
    assert_user_error(code, err, f"export.sglang=true: {folder} holds a {kind} drafter")
    assert "export.sglang=false" in err or "SGLang loads as it is" in err
    assert written(run_dir) == set()


def test_a_run_asking_sglang_for_p_eagle_stops_before_sampling(capsys, tmp_path):
    run_dir = tmp_path / "run"
    code, err = cli(capsys, "run", "+recipe=smoke_peagle", f"run_dir={run_dir}", "export.sglang=true")
    assert_user_error(code, err, "export.sglang=true with drafter=peagle: SGLang has no P-EAGLE drafter")
    assert written(run_dir) == set()


def test_eval_prompts_past_the_context_are_skipped_and_duplicate_ids_renamed(capsys, exported, tmp_path):
    long = "word " * 700  # over the tiny Llama's 2048 positions in its byte-level tokens
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hi."}, {"id": "a", "prompt": "Count."},
                                                 {"id": "b", "prompt": long}, {"id": "c", "prompt": "Name one."}])
    run_dir = tmp_path / "run"
    code = in_process("evaluate", "+recipe=smoke", f"run_dir={run_dir}", f"eval.dataset={prompts}",
                      *QUICK_EVAL[:1], *QUICK_EVAL[2:], "eval.max_prompts=null")
    said = "".join(capsys.readouterr())
    assert code in (0, None) and "Traceback" not in said, said
    assert "renamed (a -> a#2)" in said and "skipped 1 of 4 eval prompts longer than the target's context" in said
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert [p["id"] for p in report["prompts"]] == ["a", "a#2", "c"]
    assert report["skipped"] == {"prompt_too_long": 1, "ids": ["b"]}
    assert report["num_prompts"] == 3 and report["methods"]["plain"]["num_prompts"] == 3
    # data.strict=true: a repeated id is an error naming it, before anything is written
    code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={tmp_path / 'strict'}",
                    f"eval.dataset={prompts}", "data.strict=true", *QUICK_EVAL)
    assert_user_error(code, err, "prompt id 'a' appears more than once")
    assert written(tmp_path / "strict") == set()


def test_eval_prompts_all_past_the_context_are_one_line(capsys, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "x", "prompt": "word " * 700}])
    run_dir = tmp_path / "run"
    code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={run_dir}", f"eval.dataset={prompts}", *QUICK_EVAL)
    assert_user_error(code, err, "every prompt is longer than the target's context of 2048 positions")
    assert not (run_dir / "eval").exists()


# --------------------------------------------------------------------------- 6. leftovers of killed compiles

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_build_folders_of_a_process_that_is_gone_are_removed_on_the_next_run(tmp_path, monkeypatch):
    import tempfile

    from specforge_lite.runtime import graph_cache

    scratch, cache = tmp_path / "tmp", tmp_path / "graphs"
    scratch.mkdir()
    cache.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    dead, alive = _dead_pid(), os.getppid()
    left = [scratch / f"specforge_lite_build_{dead}_x1", scratch / f"specforge_lite_graph_{dead}_x2"]
    kept = [scratch / f"specforge_lite_build_{alive}_x3", scratch / "specforge_lite_test_graphs_x4"]
    for folder in left + kept:
        (folder / "inductor").mkdir(parents=True)
    (cache / f".partial-{dead}-toy-abc.pt2").write_bytes(b"half")
    (cache / f".partial-{alive}-toy-abc.pt2").write_bytes(b"half")
    (cache / "toy-abc.pt2").write_bytes(b"whole")
    graph_cache.remove_leftovers(cache)
    assert sorted(p.name for p in scratch.iterdir()) == sorted(p.name for p in kept)
    assert sorted(p.name for p in cache.iterdir()) == sorted([f".partial-{alive}-toy-abc.pt2", "toy-abc.pt2"])


def test_export_does_not_take_k_from_a_report_of_other_weights(capsys, exported, tmp_path):
    """A retrain whose evaluate failed left the old report: export used its best k and
    recommendation silently (issue 65). The report records the weights it measured; export says
    in one line that it measured others and takes none of it."""
    run_dir = tmp_path / "run"
    shutil.copytree(exported, run_dir)
    report_path = run_dir / "eval" / "report.json"
    report = json.loads(report_path.read_text())
    assert report["drafters"] == {}  # this evaluate measured plain only
    kind = json.loads((run_dir / "export" / "export.json").read_text())["drafter"]
    report.update(best_k=5, drafters={kind: {"path": "elsewhere", "weights": {"model.safetensors": "an-older-one"}}})
    report_path.write_text(json.dumps(report))
    code, err = cli(capsys, "export", "+recipe=smoke", f"run_dir={run_dir}")
    assert code in (0, None), err
    log = sorted(run_dir.glob("logs/*-export/__main__.log"))[-1].read_text()  # Hydra's log of this export
    lines = [line for line in log.splitlines() if "measured other weights" in line]
    assert len(lines) == 1 and str(report_path) in lines[0] and "WARNING" in lines[0], log
    info = json.loads((run_dir / "export" / "export.json").read_text())
    assert info["speculative_tokens_source"].startswith("export.fallback_tokens") and info["speculative_tokens"] != 5
    report["drafters"] = {}  # the same report of this drafter's run (written after it): its k is taken
    report_path.write_text(json.dumps(report))
    shutil.rmtree(run_dir / "logs")  # Hydra's log folder of an export in the same second is the one above
    code, err = cli(capsys, "export", "+recipe=smoke", f"run_dir={run_dir}")
    assert code in (0, None), err
    assert "measured other" not in sorted(run_dir.glob("logs/*-export/__main__.log"))[-1].read_text()
    assert json.loads((run_dir / "export" / "export.json").read_text())["speculative_tokens"] == 5


@pytest.mark.parametrize("overrides,message", [
    (["export.drafter_dir=/no/such/drafter"], "export.drafter_dir='/no/such/drafter': no such folder"),
    (["export.sglang=true"], "the SGLang layout has no norm_before_residual"),  # known only once the drafter is read
])
def test_a_refused_export_leaves_the_run_folder_as_it_was(capsys, exported, tmp_path, overrides, message):
    """It named no key for a missing drafter folder, and wrote its accounting record although it
    refused (issue 65): a refused stage's records go back to what they were."""
    run_dir = tmp_path / "run"
    shutil.copytree(exported, run_dir)
    (run_dir / "accounting" / "export.rank0.json").unlink(missing_ok=True)  # so that a record written is new
    before = digest(run_dir)
    code, err = cli(capsys, "export", "+recipe=smoke", f"run_dir={run_dir}", *overrides)
    assert_user_error(code, err, message)
    assert digest(run_dir) == before
