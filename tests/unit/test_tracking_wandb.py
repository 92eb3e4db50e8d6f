"""wandb as its users set it (`train.wandb.*`): project, entity, group, tags, run name, resume;
offline by default. Real wandb, offline mode, no network."""

from __future__ import annotations

import os

import pytest

from specforge_lite.training.tracking import Tracker, job_id
from tests.conftest import compose

pytest.importorskip("wandb")


def wandb_cfg(tmp_path, *extra: str):
    return compose(["stage=train", "+recipe=smoke", "train.tracker=wandb", f"run_dir={tmp_path}", *extra])


def test_run_named_grouped_tagged_and_resumed(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default must be offline by itself
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    cfg = wandb_cfg(tmp_path, "train.wandb.project=drafters", "train.wandb.entity=my-team",
                    "train.wandb.group=sweep-7", "train.wandb.tags=[eagle3,h100]", "train.wandb.name=first",
                    "train.wandb.resume=allow")
    out = tmp_path / "train"
    tracker = Tracker(cfg, out, enabled=True)
    try:
        run = tracker.run
        assert os.environ["WANDB_MODE"] == "offline" and run.offline
        assert (run.project, run.group, run.name, sorted(run.tags)) == ("drafters", "sweep-7", "first", ["eagle3", "h100"])
        assert run.entity == "my-team"
        first_id = run.id
        tracker.log({"loss": 1.0}, step=1)
    finally:
        tracker.close()
    assert (out / "wandb_run_id").read_text().strip() == first_id
    again = Tracker(cfg, out, enabled=True)  # a restarted job: the same run, continued
    try:
        assert again.run.id == first_id
        again.log({"loss": 0.5}, step=2)
    finally:
        again.close()
    runs = sorted((out / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>, with "-1" appended when both started within the same second
    assert len(runs) == 2 and all(p.name.split("-")[3] == first_id for p in runs)


def test_defaults_and_one_run_per_job(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    assert job_id() == "job-42"
    cfg = wandb_cfg(tmp_path)
    out = tmp_path / "train"
    assert Tracker(cfg, out, enabled=False).run is None  # ranks other than 0 log nothing
    tracker = Tracker(cfg, out, enabled=True)
    try:
        # no resume asked: a new id each time, nothing kept; the job id groups the run
        assert (tracker.run.project, tracker.run.name, tracker.run.group) == ("specforge_lite", "smoke", "job-42")
        assert not (out / "wandb_run_id").exists()
    finally:
        tracker.close()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # plain torchrun's default id names no job
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert job_id() is None


@pytest.mark.parametrize("setting, message", [
    ("train.wandb.resume=sometimes", "train.wandb.resume"),
    ("train.wandb.mode=cloud", "train.wandb.mode"),
    ("train.wandb.id=has/slash", "train.wandb.id"),
])
def test_bad_wandb_settings_stop_at_the_door(setting, message):
    from specforge_lite import SpecforgeError
    from specforge_lite.stages.door import validate_config

    with pytest.raises(SpecforgeError, match=message):
        validate_config(compose(["stage=train", "+recipe=smoke", setting]))
