"""The sample stage end to end through the real CLI: output, resume after SIGKILL,
data-parallel ranks, refused resumes, and the real SmolLM2 target."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from specforge_lite.data.samples import completed_shards, load_samples
from tests.conftest import REPO, run_cli


def write_prompts(path, n):
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"p{i:03d}", "messages": [
                {"role": "user", "content": f"Question number {i}: " + "why? " * (i % 7)},
                {"role": "assistant", "content": "An answer the target will replace."}]}) + "\n")
    return path


def smoke_args(run_dir, source, *extra):
    return ["sample", "+recipe=smoke", f"run_dir={run_dir}", f"data.source={source}",
            "data.heldout_fraction=0", *extra]


def rows_by_id(run_dir):
    ds = load_samples(run_dir / "samples")
    ids = ds["id"]
    assert len(ids) == len(set(ids)), "duplicate records"
    return {row["id"]: row for row in ds}


def test_smoke_sample_writes_dataset_and_provenance(tmp_path):
    run_cli("sample", "+recipe=smoke", f"run_dir={tmp_path}", check=True)
    out = tmp_path / "samples"
    for name in ("config.yaml", "versions.json", "meta.json", "split.json"):
        assert (out / name).exists(), name
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] and meta["target"] == "builtin:tiny-llama"
    assert meta["sampling"]["max_new_tokens"] == 16 and "torch" in meta["versions"]
    assert meta["generation_s"] > 0 and meta["num_generated_tokens"] > 0
    rows = rows_by_id(tmp_path)
    assert len(rows) == meta["num_rows"] == meta["data"]["num_train"]
    heldout = set(json.loads((out / "split.json").read_text())["heldout_ids"])
    assert heldout and not heldout & set(rows)
    for row in rows.values():
        assert len(row["input_ids"]) == len(row["loss_mask"]) and 0 < sum(row["loss_mask"]) < len(row["loss_mask"])
        assert row["messages"][-1]["role"] == "assistant"
        assert row["num_generated_tokens"] > 0


def test_a_damaged_meta_json_or_a_stray_shard_is_repaired_not_a_loop(tmp_path):
    """Issue 52: a damaged samples/meta.json used to stop sample and train with no way out, and a
    stray shard file made train ask for the sample stage, which had nothing to do: a loop. Now
    each shard's own record of its settings keeps it, meta.json is written again, and a shard
    file that is none of these samples' is removed, with a line each."""
    run_cli("sample", "+recipe=smoke", f"run_dir={tmp_path}", check=True)
    out, data = tmp_path / "samples", tmp_path / "samples" / "data"
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    (out / "meta.json").write_text('{"complete": tr')
    train = ["+recipe=smoke", f"run_dir={tmp_path}", "train.max_steps=1", "train.checkpoint_every=0",
             "train.tracker=none"]
    proc = run_cli("train", *train, check=True)
    said = proc.stdout + proc.stderr
    assert f"{out / 'meta.json'}: invalid JSON" in said and "keeping the shards that record these settings" in said
    assert "resuming: 4 of this rank's 4 shards already written" in said  # none sampled again
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before
    assert json.loads((out / "meta.json").read_text())["complete"]
    (data / "shard-00099.parquet").write_bytes(before["shard-00000.parquet"])  # a copy from elsewhere
    proc = run_cli("train", *train, "train.max_steps=2", check=True)
    said = proc.stdout + proc.stderr
    assert f"{data / 'shard-00099.parquet'} is not one of these samples' 4 shards; removed" in said
    assert sorted(completed_shards(data)) == [0, 1, 2, 3]


def test_kill_and_resume_loses_nothing_and_duplicates_nothing(tmp_path, rank_python):
    """Killed (SIGKILL, through rank_python's shim: the forked process's session is killed) mid-run."""
    source = write_prompts(tmp_path / "prompts.jsonl", 60)
    args = ["sample.shard_size=2", "sample.batch_size=2", "sample.max_new_tokens=64"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen([rank_python, "-m", "specforge_lite", *smoke_args(killed, source, *args)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while len(completed_shards(killed / "samples" / "data")) < 3:
        assert proc.poll() is None, "sample finished or died before it could be killed"
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written_before = len(completed_shards(killed / "samples" / "data"))
    assert 3 <= written_before < 30, "the kill must land mid-run"

    resumed = run_cli(*smoke_args(killed, source, *args), check=True)
    assert f"resuming: {written_before} of this rank's 30 shards already written" in resumed.stdout + resumed.stderr

    clean = tmp_path / "clean"
    run_cli(*smoke_args(clean, source, *args), check=True)
    got, want = rows_by_id(killed), rows_by_id(clean)
    assert sorted(got) == sorted(want) == [f"p{i:03d}" for i in range(60)]
    assert got == want


def test_data_parallel_ranks_split_one_prompt_set(tmp_path, rank_python):
    source = write_prompts(tmp_path / "prompts.jsonl", 12)
    args = ["sample.shard_size=2", "sample.max_new_tokens=8"]
    run_dir = tmp_path / "dp"
    procs = [subprocess.Popen([rank_python, "-m", "specforge_lite",
                               *smoke_args(run_dir, source, *args, f"sample.rank={r}", "sample.world_size=2")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    # rank 0 may finish first; a re-run (any world size) completes the metadata and writes nothing new
    run_cli(*smoke_args(run_dir, source, *args), check=True)
    single = tmp_path / "single"
    run_cli(*smoke_args(single, source, *args), check=True)
    assert rows_by_id(run_dir) == rows_by_id(single)
    assert json.loads((run_dir / "samples" / "meta.json").read_text())["complete"]


def test_resume_with_other_settings_is_refused(tmp_path):
    run_cli("sample", "+recipe=smoke", f"run_dir={tmp_path}", check=True)
    proc = run_cli("sample", "+recipe=smoke", f"run_dir={tmp_path}", "sample.max_new_tokens=7")
    assert proc.returncode == 2
    assert "holds samples made with other settings" in proc.stderr
    # the target's dtype is recorded and decided once: a resume that names another is refused
    stats = json.loads((tmp_path / "samples" / "data" / "shard-00000.stats.json").read_text())
    assert json.loads((tmp_path / "samples" / "meta.json").read_text())["target_dtype"]["used"] == "float32"
    assert stats["target_dtype"] == "float32"
    proc = run_cli("sample", "+recipe=smoke", f"run_dir={tmp_path}", "target.dtype=bfloat16")
    assert proc.returncode == 2
    assert (f"{tmp_path / 'samples'} holds samples the target drew in float32; target.dtype=bfloat16 would mix "
            "bfloat16 and float32 shards: set target.dtype=float32") in proc.stderr


def test_another_model_in_the_same_folder_is_not_taken_for_the_old_one(tmp_path):
    """Samples and a trained drafter belong to the target's files, not only its path: a new model
    put in the same folder is refused by the sampler (and would be trained anew), never reused."""
    import shutil

    from specforge_lite.targets.loading import resolve_target_path

    target = tmp_path / "target"
    shutil.copytree(resolve_target_path("builtin:tiny-llama"), target)
    run_cli("sample", "+recipe=smoke", f"run_dir={tmp_path / 'run'}", f"target.path={target}", check=True)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "rms_norm_eps": config["rms_norm_eps"] * 2}))
    proc = run_cli("sample", "+recipe=smoke", f"run_dir={tmp_path / 'run'}", f"target.path={target}")
    assert proc.returncode == 2
    assert "holds samples made with other settings" in proc.stderr and "target_files.config_sha256" in proc.stderr


def test_vllm_backend_without_vllm_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    proc = run_cli("sample", "+recipe=smoke", f"run_dir={tmp_path}", "sample.backend=vllm",
                   f"sample.vllm.python={missing}")
    assert proc.returncode == 2
    assert f"the vLLM interpreter {missing} does not exist" in proc.stderr and "make vllm" in proc.stderr


def test_later_stage_without_its_input_fails_clearly_or_makes_it(tmp_path):
    proc = run_cli("export", "+recipe=smoke", f"run_dir={tmp_path}")
    assert proc.returncode == 2 and "run the train stage first" in proc.stderr
    # train needs samples: a single process samples them first
    proc = run_cli("train", "+recipe=smoke", f"run_dir={tmp_path}", "train.max_steps=2", check=True)
    assert "running the sample stage first" in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "samples" / "meta.json").read_text())["complete"]
    assert (tmp_path / "train" / "drafter" / "model.safetensors").exists()


@pytest.mark.slow
def test_sample_real_smollm2(tmp_path):
    run_cli("sample", "+recipe=eagle_smollm2", f"run_dir={tmp_path}", f"samples_dir={tmp_path / 'samples'}",
            "data.max_samples=4", "sample.max_new_tokens=24", "sample.batch_size=4",
            "sample.max_prompt_length=200", "sample.backend=hf", check=True)  # hf: no compile for 4 prompts
    rows = rows_by_id(tmp_path)
    meta = json.loads((tmp_path / "samples" / "meta.json").read_text())
    assert len(rows) == meta["num_rows"] >= 1
    assert len(rows) + meta["skipped"].get("prompt_too_long", 0) + meta["skipped"].get("empty_reply", 0) == 4
    from specforge_lite.targets.loading import load_tokenizer
    from tests.conftest import target_cfg

    tokenizer = load_tokenizer(target_cfg("builtin:smollm2-135m-instruct"))
    for row in rows.values():
        replies = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
        for message in row["messages"]:  # every assistant turn is the target's and is masked in
            if message["role"] == "assistant" and len(row["input_ids"]) < 512:
                assert message["content"] in replies
        assert len(replies.split()) > 3  # a real model writes words
