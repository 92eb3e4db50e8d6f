"""Compact offline features: quantize / dequantize round trips within their error bounds,
widths that are not a multiple of the group size, the byte formulas against what is
stored, the sparse teacher, and a cache written in one format never read as another."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_lite import SpecforgeError
from specforge_lite.training.feature_formats import (FILL_LOGIT, FORMATS, GROUP_SIZE, QMAX, SparseTeacher, bytes_per_token,
                                            bytes_per_value, dequantize, quantize, sparse_teacher_logits,
                                            topk_teacher)
from specforge_lite.training.features import FeatureCache, cache_key
from tests.conftest import compose

ROWS = [{"id": f"c{i}", "input_ids": list(range(3, 10 + i)), "loss_mask": [1] * (7 + i)} for i in range(4)]


def with_outliers(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=gen)
    x[:, :: max(1, width // 5)] *= 80.0  # outlier channels, as real hidden states have
    return x


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("width", [128, 100, 7, 576])
def test_round_trip_error_is_within_half_a_step_of_its_group(fmt, width):
    x = with_outliers(5, width)
    parts = quantize(x, fmt)
    y = dequantize(parts, fmt, width)
    assert y.shape == x.shape and y.dtype == torch.float32
    wide = -(-width // GROUP_SIZE) * GROUP_SIZE
    padded = torch.nn.functional.pad(x, (0, wide - width)).view(5, -1, GROUP_SIZE)
    step = (padded.abs().amax(-1, keepdim=True) / QMAX[fmt]).expand_as(padded).reshape(5, wide)[:, :width]
    # half a quantization step, plus the fp16 rounding of the scale itself (relative 2^-11 of qmax steps)
    assert ((y - x).abs() <= step * (0.5 + QMAX[fmt] * 2.0 ** -10) + 1e-6).all()


def test_outliers_only_coarsen_their_own_group():
    x = torch.randn(4, 256) * 0.1
    x[:, 0] = 500.0  # one huge channel in the first group
    y = dequantize(quantize(x, "int4"), "int4", 256)
    rest = slice(GROUP_SIZE, 256)
    assert ((y[:, rest] - x[:, rest]).norm() / x[:, rest].norm()) < 0.2  # one scale per row would zero these
    per_row = dequantize(quantize(x, "int4", group_size=256), "int4", 256)
    assert (per_row[:, rest] == 0).all()


def test_int4_packs_two_values_a_byte_and_round_trips_exactly_on_its_grid():
    grid = torch.arange(-7, 8, dtype=torch.float32)
    x = torch.cat([grid, grid.flip(0), torch.tensor([7.0, -7.0])]).repeat(3, 1) * 0.25  # width 32
    parts = quantize(x, "int4", group_size=32)
    assert parts["q"].dtype == torch.uint8 and parts["q"].shape == (3, 16)
    assert torch.equal(dequantize(parts, "int4", 32), x)


def test_zero_and_tiny_rows_stay_finite():
    x = torch.zeros(2, 64)
    x[1, 3] = 1e-30
    for fmt in ("int8", "int4"):
        y = dequantize(quantize(x, fmt), fmt, 64)
        assert torch.isfinite(y).all() and y.abs().max() < 1e-6


def test_dequantize_refuses_a_width_the_parts_cannot_hold():
    parts = quantize(torch.randn(2, 64), "int8")
    with pytest.raises(ValueError, match="cannot hold"):
        dequantize(parts, "int8", 65)
    with pytest.raises(ValueError, match="unknown feature format"):
        quantize(torch.randn(2, 64), "int3")
    with pytest.raises(ValueError, match="even"):
        quantize(torch.randn(2, 64), "int4", group_size=3)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("width", [576, 1728, 100])
def test_bytes_per_value_is_what_quantize_stores(fmt, width):
    parts = quantize(torch.randn(3, width), fmt)
    stored = sum(t.numel() * t.element_size() for t in parts.values())
    assert stored == pytest.approx(3 * width * bytes_per_value(fmt, width))


def test_bytes_per_token_against_the_peers_layout():
    h = 576
    assert bytes_per_token("bf16", h, 3) == (3 + 1) * h * 2  # SpecForge's and speculators' layout
    assert bytes_per_token("int4_topk", h, 3) <= (3 + 1) * h * 2 / 4  # the goal
    assert bytes_per_token("int8", h, 3) < bytes_per_token("bf16", h, 3)
    assert bytes_per_token("int4", h, 3) < bytes_per_token("int8", h, 3)


def test_sparse_teacher_is_the_top_k_renormalised():
    logits = torch.randn(2, 3, 50)
    parts = topk_teacher(logits.view(6, 50), torch.ones(6, dtype=torch.bool), top_k=5)
    dense = sparse_teacher_logits(parts["topk.values"].view(2, 3, 5), parts["topk.ids"].view(2, 3, 5), 50)
    p, q = torch.softmax(logits, -1), torch.softmax(dense, -1)
    top = p.topk(5, -1)
    expected = torch.zeros_like(p).scatter_(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    assert torch.allclose(q, expected, atol=2e-3)  # fp16 values
    assert (dense[dense != FILL_LOGIT].numel() == 2 * 3 * 5) and torch.equal(q.argmax(-1), p.argmax(-1))


def test_the_preparer_reads_a_sparse_teacher(tiny_target):
    from specforge_lite.drafters.common import draft_vocab_preparer
    from specforge_lite.training.features import draft_vocab_targets

    target, _ = tiny_target
    vocab = torch.arange(0, target.config.vocab_size, 2)
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    prepare = draft_vocab_preparer(target, vocab, t2d)
    last = torch.randn(1, 6, target.config.hidden_size)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    head = target.get_output_embeddings().weight
    logits, in_draft = draft_vocab_targets(head, head[vocab], last, t2d, mask)
    stored = topk_teacher(logits[0], in_draft[0], top_k=4)
    teacher = SparseTeacher(stored["topk.values"][None].float(), stored["topk.ids"][None].long(),
                            stored["in_draft"][None].bool())
    dense, sparse = {"loss_mask": mask}, {"loss_mask": mask}
    prepare(dense, None, last, True)
    prepare(sparse, None, teacher, True)
    assert sparse["last_hidden"] is None and torch.equal(sparse["valid"], dense["valid"])
    assert torch.equal(sparse["target_logits"].argmax(-1), dense["target_logits"].argmax(-1))


# --------------------------------------------------------------------------- the cache

def build(folder, target, fmt, layers=(1, 2, 3)):
    cache = FeatureCache(folder, shard_size=2, feature_format=fmt)
    cache.prepare(ROWS, target.config.hidden_size, list(layers),
                  cache_key(ROWS, "builtin:tiny-llama", "torch.float32", list(layers), fmt))
    cache.build(target, ROWS, list(layers), pad_id=0, batch_size=2)
    return cache


@pytest.mark.parametrize("first,second", [("bf16", "int8"), ("int8", "int4"), ("int4", "bf16")])
def test_a_cache_in_another_format_is_rebuilt_never_misread(tmp_path, tiny_target, first, second):
    target, _ = tiny_target
    build(tmp_path, target, first)
    shard = tmp_path / "shard-00000.safetensors"
    os.utime(shard, ns=(0, 0))
    cache = build(tmp_path, target, second)
    assert shard.stat().st_mtime_ns != 0  # the key named another format: emptied and built again
    assert json.loads((tmp_path / "meta.json").read_text())["key"]["stored_dtype"] != first
    aux, last = cache.get(1)
    reference = build(tmp_path / "bf16", target, "bf16").get(1)
    assert aux.shape == reference[0].shape and last.shape == reference[1].shape
    cos = torch.nn.functional.cosine_similarity(last, reference[1], dim=-1)
    assert cos.min() > 0.95


def test_a_shard_of_another_format_is_rebuilt_even_under_the_same_key(tmp_path, tiny_target):
    """A shard whose own metadata names another format (copied in by hand) is not trusted."""
    target, _ = tiny_target
    build(tmp_path / "b", target, "bf16")
    cache = build(tmp_path / "q", target, "int4")
    (tmp_path / "q" / "shard-00000.safetensors").write_bytes((tmp_path / "b" / "shard-00000.safetensors").read_bytes())
    with pytest.raises(SpecforgeError, match="holds bf16 features, not int4"):
        FeatureCache(tmp_path / "q", 2, "int4").get(0)
    cache.build(target, ROWS, [1, 2, 3], pad_id=0, batch_size=2)  # the next build replaces it
    assert "aux_scale.0" in load_file(str(tmp_path / "q" / "shard-00000.safetensors"))
    assert FeatureCache(tmp_path / "q", 2, "int4").get(0)[1].shape[0] == len(ROWS[0]["input_ids"])


def test_a_shard_without_a_recorded_format_reads_as_bf16(tmp_path, tiny_target):
    """Caches written before formats were recorded: bf16 shards without metadata stay readable."""
    target, _ = tiny_target
    build(tmp_path, target, "bf16")
    shard = tmp_path / "shard-00000.safetensors"
    save_file(load_file(str(shard)), str(shard))  # metadata dropped
    aux, last = FeatureCache(tmp_path, 2, "bf16").get(1)
    assert last.dtype == torch.float32 and aux.shape[-1] == 3 * target.config.hidden_size
    # readable, but no checksum was recorded then: the next build writes it again, checked
    assert not FeatureCache(tmp_path, 2, "bf16")._intact(shard)
    assert not FeatureCache(tmp_path, 2, "int8")._intact(shard)


def test_estimate_bytes_uses_the_format():
    bf16 = FeatureCache.estimate_bytes(1000, 576, 3)
    assert bf16 == 1000 * 4 * 576 * 2
    assert FeatureCache.estimate_bytes(1000, 576, 3, "int4_topk") == int(1000 * bytes_per_token("int4_topk", 576, 3))
    assert FeatureCache.estimate_bytes(1000, 576, 3, "int4_topk") <= bf16 / 4


def test_int4_topk_without_a_teacher_is_refused(tmp_path, tiny_target):
    target, _ = tiny_target
    cache = FeatureCache(tmp_path, 2, "int4_topk")
    cache.prepare(ROWS, target.config.hidden_size, [1], cache_key(ROWS, "builtin:tiny-llama", "x", [1], "int4_topk"))
    with pytest.raises(SpecforgeError, match="draft vocab"):
        cache.build(target, ROWS, [1], pad_id=0, batch_size=2)


def test_the_draft_vocab_is_in_the_int4_topk_key():
    a = cache_key(ROWS, "builtin:tiny-llama", "x", [1], "int4_topk", torch.arange(8))
    b = cache_key(ROWS, "builtin:tiny-llama", "x", [1], "int4_topk", torch.arange(1, 9))
    assert a["draft_vocab"] != b["draft_vocab"] and a["stored_dtype"] != cache_key(ROWS, "builtin:tiny-llama", "x", [1])["stored_dtype"]


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_is_accepted(fmt):
    from specforge_lite.stages.door import config_problems

    assert config_problems(compose(["+recipe=smoke", f"train.feature_format={fmt}"])) == []


def test_an_unknown_format_is_refused_naming_the_key():
    from specforge_lite.stages.door import config_problems

    problems = config_problems(compose(["+recipe=smoke", "train.feature_format=int3"]))
    assert len(problems) == 1 and "train.feature_format" in problems[0]


def test_int4_topk_is_refused_for_drafters_that_read_the_last_state():
    from specforge_lite.stages.door import config_problems

    problems = config_problems(compose(["+recipe=smoke_medusa", "train.feature_format=int4_topk"]))
    assert len(problems) == 1 and "train.feature_format=int4_topk" in problems[0] and "medusa" in problems[0]


def test_int4_topk_is_refused_for_a_draft_vocab_int16_cannot_index():
    from specforge_lite.stages.door import config_problems

    problems = config_problems(compose(["+recipe=smoke", "train.feature_format=int4_topk",
                                        "drafter.draft_vocab_size=40000"]))
    assert len(problems) == 1 and "drafter.draft_vocab_size=40000" in problems[0]
