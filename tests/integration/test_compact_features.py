"""Offline training on the tiny target with compact features (`train.feature_format`): the
cache holds what the format says (int4 aux states close to the target's, the teacher's top
draft-vocab logits for int4_topk), training runs on it, and the next run in another format
rebuilds the cache instead of reading it."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from specforge_lite.drafters import eagle3
from specforge_lite.drafters.vocab import count_tokens
from specforge_lite.training.feature_formats import dequantize
from specforge_lite.training.features import collate, draft_vocab_targets, target_hidden
from specforge_lite.stages.train import training_rows
from specforge_lite.training.strategies.base import target_compute
from specforge_lite.targets.loading import load_target
from tests.conftest import compose, run_cli

OFFLINE = ["+recipe=smoke", "train.mode=offline", "train.use_samples=false", "train.max_steps=2",
           "train.log_every=1", "train.checkpoint_every=0", "target.dtype=float32", "train.source_conversations=4",
           "train.tracker=none",
           # the format's own exactness: an fp32 target forward, so the stored top ids are the reference's
           # (a bf16 forward batched otherwise than the reference reorders near-ties: test_offline_features)
           "train.target_autocast=false"]


def shard_tensors(run_dir) -> tuple[dict, dict]:
    tensors, metadata = {}, {}
    for shard in sorted((run_dir / "train" / "features").glob("shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            metadata = handle.metadata()
            tensors.update({k: handle.get_tensor(k) for k in handle.keys()})
    return tensors, metadata


def reference(fmt: str):
    """The rows, the target's aux states and draft-vocab teacher (computed as the stage computes
    them) of what these settings train on."""
    cfg = compose(["stage=train", *OFFLINE, f"train.feature_format={fmt}"])
    target, tokenizer = load_target(cfg.target)
    rows = training_rows(cfg, tokenizer)
    drafter = eagle3.build(cfg, target, count_tokens(((r["input_ids"], r["loss_mask"]) for r in rows),
                                                      target.config.vocab_size))
    head = target.get_output_embeddings().weight
    out = []
    for row in rows:
        batch = collate([row], tokenizer.pad_token_id, target.device)
        aux, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], eagle3.target_layers(drafter),
                                  target_compute(cfg))  # as the stage computes it
        logits, in_draft = draft_vocab_targets(head, head[drafter.draft_vocab], last, drafter.t2d, batch["loss_mask"])
        out.append((aux[0], logits[0], in_draft[0]))
    return out


def test_int4_topk_trains_and_another_format_rebuilds_the_cache(tmp_path):
    run_dir = tmp_path / "run"
    run_cli("train", *OFFLINE, "train.feature_format=int4_topk", f"run_dir={run_dir}", check=True)
    tensors, metadata = shard_tensors(run_dir)
    assert metadata["feature_format"] == "int4_topk"
    assert not any(k.startswith("last.") for k in tensors)  # the teacher is stored instead
    expected = reference("int4_topk")
    assert len([k for k in tensors if k.startswith("topk.ids.")]) == len(expected)
    width = int(metadata["aux_width"])
    for i, (aux, logits, in_draft) in enumerate(expected):
        ids = tensors[f"topk.ids.{i}"].long()
        top = logits.topk(ids.shape[-1], -1)
        # the stored ids are the top draft ids (ties aside: compare the logits they pick)
        assert torch.allclose(logits.gather(-1, ids), top.values, atol=1e-3)
        assert torch.allclose(tensors[f"topk.values.{i}"].float(), top.values, atol=1e-2, rtol=1e-3)
        assert torch.equal(tensors[f"in_draft.{i}"].bool(), in_draft)
        restored = dequantize({"q": tensors[f"aux.{i}"], "scale": tensors[f"aux_scale.{i}"]}, "int4", width)
        assert torch.nn.functional.cosine_similarity(restored, aux, dim=-1).min() > 0.97
    metrics = json.loads((run_dir / "train" / "metrics.json").read_text())
    assert metrics["total_steps"] == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in metrics["history"])
    assert (run_dir / "train" / "drafter").is_dir()

    proc = run_cli("train", *OFFLINE, "train.feature_format=int8", f"run_dir={run_dir}", check=True)
    assert "rebuilding them" in proc.stdout + proc.stderr and "stored_dtype" in proc.stdout + proc.stderr
    tensors, metadata = shard_tensors(run_dir)
    assert metadata["feature_format"] == "int8" and tensors["last.0"].dtype == torch.int8
    assert not any(k.startswith("topk.") for k in tensors)
