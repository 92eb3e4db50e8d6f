"""Issue 38: the 70B card's train command, as the card prints it, on 2 CPU ranks with the
rehearsal's stand-in target: every rank trains on real tokens at every step, with the recipe's
train.tokens_per_step=auto and with train.batch_size=1 (raised to the world size, and said)."""

from __future__ import annotations

import pytest

from specforge_lite.scale.rehearse import load_spec, rehearse

pytestmark = pytest.mark.slow


# the card's own train.tokens_per_step=auto is checked on the full rehearsal (test_rehearse);
# the card with batch size 1 here
@pytest.mark.parametrize("extra,mode", [({"train.tokens_per_step": "null", "train.batch_size": "1"}, "batch_size")],
                         ids=["batch_size=1"])
def test_every_rank_trains_on_real_tokens_at_every_step(tmp_path, capfd, extra, mode, rank_python):
    result = rehearse("eagle_llama70b", 2, tmp_path, labels=("sample", "train"), extra=extra, python=rank_python)
    train = next(c for c in result["commands"] if c["label"] == "train")
    card = next(c["run"] for c in load_spec("eagle_llama70b")["commands"] if c["label"] == "train")
    assert train["card"] == card and train["returncode"] == 0, result
    assert result["passed"], result["failures"]
    steps = load_spec("eagle_llama70b")["rehearsal"]["overrides"]
    assert train["steps"] == int(next(o for o in steps if o.startswith("train.max_steps=")).split("=")[1])
    assert len(train["real_tokens_per_rank"]) == 2 and all(n > 0 for n in train["real_tokens_per_rank"])
    assert train["idle_steps_per_rank"] == [0, 0]
    batching = train["batching"]
    assert batching["mode"] == mode and batching["ranks"] == 2 and 0 <= batching["padding_share"] < 1
    logs = capfd.readouterr()
    if mode == "batch_size":
        assert batching["raised_from"] == 1 and batching["batch_size"] == 2
        assert "train.batch_size=1 raised to 2, the world size" in logs.out + logs.err
    else:
        assert batching["micro_batch_per_rank"] >= 1 and "batch: train.tokens_per_step=auto" in logs.out + logs.err


def test_a_rank_that_idles_fails_the_rehearsal(tmp_path):
    import json

    from specforge_lite.scale.rehearse import rank_counts

    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({"tokens_per_rank": [40, 0], "idle_steps_per_rank": [0, 2], "steps": 2}))
    assert rank_counts(path)["idle_problem"] == "trained on no real token: rank 1 in 2 step(s)"
    assert "not written" in rank_counts(tmp_path / "none.json")["idle_problem"]
