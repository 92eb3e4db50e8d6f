"""How the offline feature cache stores a hidden-state tensor: bf16, or quantized to int8 / int4.

Pure functions over tensors. Quantization is symmetric and group-wise along the channels:
every run of GROUP_SIZE consecutive channels of one token gets its own fp16 scale
(absmax / qmax), so an outlier channel only coarsens its own group. int4 packs two
values per byte (low nibble first). A width that is not a multiple of GROUP_SIZE is
zero-padded for quantizing and cut back on reading.

`int4_topk` stores the aux hidden states as int4 and, instead of the final hidden state,
the teacher itself: the TOP_K largest target logits over the draft vocabulary (fp16 values,
int16 draft ids) and whether the full-vocab argmax is in the draft vocab. Training then
learns from the top-k distribution renormalised (the rest of the draft vocab gets zero
probability), see `sparse_teacher_logits`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FORMATS = ("bf16", "int8", "int4", "int4_topk")

# channels per fp16 scale: the smallest power of two whose scale overhead keeps int4_topk under a
# quarter of bf16's bytes (outlier channels: error by group size in docs/BENCHMARKS.md "Compact offline features")
GROUP_SIZE = 32
# teacher logits kept per position by int4_topk: the tau check in docs/BENCHMARKS.md "Compact offline features"
TOP_K = 32
QMAX = {"int8": 127, "int4": 7}
# a logit no softmax gives weight to, for the draft ids outside the stored top k (finite: no NaN in KL)
FILL_LOGIT = -1e9


def hidden_format(feature_format: str) -> str:
    """How the hidden states (aux, and last where stored) are stored: bf16, int8 or int4."""
    return "int4" if feature_format == "int4_topk" else feature_format


def stores_last(feature_format: str) -> bool:
    """Whether the final hidden state is stored (all formats but int4_topk, which stores the teacher)."""
    return feature_format != "int4_topk"


def _padded(width: int, group_size: int) -> int:
    return -(-width // group_size) * group_size


def quantize(x: torch.Tensor, fmt: str, group_size: int = GROUP_SIZE) -> dict[str, torch.Tensor]:
    """[T, W] float -> the stored parts: `{"q"}` bf16 for bf16; `{"q" int8 [T, Wp], "scale" fp16
    [T, Wp / G]}` for int8; `{"q" uint8 [T, Wp / 2] (two values a byte), "scale"}` for int4.
    Wp is W rounded up to a multiple of G (zero channels); `dequantize` needs W back."""
    if fmt == "bf16":
        return {"q": x.to(torch.bfloat16).contiguous()}
    if fmt not in QMAX:
        raise ValueError(f"unknown feature format {fmt!r} (one of {', '.join(FORMATS)})")
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group size {group_size}: must be even and at least 2")
    tokens, width = x.shape
    wide = _padded(width, group_size)
    x = torch.nn.functional.pad(x.float(), (0, wide - width)).view(tokens, wide // group_size, group_size)
    qmax = QMAX[fmt]
    # fp16 scales: the ratio's range (tiny groups of padding, huge outliers) clamped to what fp16 holds
    scale = (x.abs().amax(-1, keepdim=True) / qmax).clamp(min=2.0 ** -24, max=65504.0).half()
    q = torch.round(x / scale.float()).clamp(-qmax, qmax).to(torch.int8).view(tokens, wide)
    scale = scale.view(tokens, wide // group_size)
    if fmt == "int8":
        return {"q": q.contiguous(), "scale": scale.contiguous()}
    nibbles = (q + 8).to(torch.uint8)  # -7..7 -> 1..15
    return {"q": (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous(), "scale": scale.contiguous()}


def dequantize(parts: dict[str, torch.Tensor], fmt: str, width: int) -> torch.Tensor:
    """The stored parts (from `quantize`) -> float32 [T, width]."""
    q = parts["q"]
    if fmt == "bf16":
        return q.float()
    scale = parts["scale"]
    tokens, groups = scale.shape
    if fmt == "int8":
        values = q.float()
    elif fmt == "int4":  # nibbles unpacked into a uint8 buffer, shifted to signed once in float
        values = torch.empty(*q.shape, 2, dtype=torch.uint8, device=q.device)
        values[..., 0], values[..., 1] = q & 0xF, q >> 4
        values = values.view(tokens, -1).float().sub_(8)
    else:
        raise ValueError(f"unknown feature format {fmt!r} (one of {', '.join(FORMATS)})")
    wide = values.shape[1]
    if wide % groups or wide < width:
        raise ValueError(f"stored features of width {wide} with {groups} scales cannot hold {width} channels")
    values = values.view(tokens, groups, wide // groups) * scale.float().unsqueeze(-1)
    return values.view(tokens, wide)[:, :width]


def bytes_per_value(fmt: str, width: int, group_size: int = GROUP_SIZE) -> float:
    """Bytes on disk per stored channel of a [T, width] tensor (padding and scales included)."""
    if fmt == "bf16":
        return 2.0
    wide = _padded(width, group_size)
    payload = wide if fmt == "int8" else wide // 2
    return (payload + 2 * wide // group_size) / width


def bytes_per_token(feature_format: str, hidden_size: int, num_aux_layers: int = 3,
                    group_size: int = GROUP_SIZE, top_k: int = TOP_K) -> int:
    """Bytes on disk per cached token: aux (num_aux_layers * H) plus `last` (H), or for
    int4_topk the top-k teacher (fp16 value + int16 id each) and one in-draft byte."""
    fmt = hidden_format(feature_format)
    aux = num_aux_layers * hidden_size * bytes_per_value(fmt, num_aux_layers * hidden_size, group_size) \
        if num_aux_layers else 0.0
    if stores_last(feature_format):
        return round(aux + hidden_size * bytes_per_value(fmt, hidden_size, group_size))
    return round(aux + top_k * (2 + 2) + 1)


def topk_teacher(logits: torch.Tensor, in_draft: torch.Tensor, top_k: int = TOP_K) -> dict[str, torch.Tensor]:
    """Target logits over the draft vocab [T, V_d] and in-draft flags [T] -> the stored teacher:
    `topk.values` fp16 [T, k], `topk.ids` int16 [T, k] (draft ids), `in_draft` uint8 [T]."""
    k = min(top_k, logits.shape[-1])
    if logits.shape[-1] > 2 ** 15:
        raise ValueError(f"a draft vocab of {logits.shape[-1]} ids does not fit int16 draft ids")
    values, ids = logits.float().topk(k, dim=-1)
    return {"topk.values": values.half().contiguous(), "topk.ids": ids.to(torch.int16).contiguous(),
            "in_draft": in_draft.to(torch.uint8).contiguous()}


def sparse_teacher_logits(values: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., k] top-k logits and their draft ids -> dense [..., vocab] logits, FILL_LOGIT
    elsewhere: a softmax over them is the top-k distribution renormalised."""
    dense = torch.full((*values.shape[:-1], vocab), FILL_LOGIT, dtype=torch.float32, device=values.device)
    return dense.scatter_(-1, ids.long(), values.float())


class SparseTeacher(NamedTuple):
    """int4_topk's teacher for a right-padded batch: `values` [B, T, k] logits, `ids` [B, T, k]
    draft ids, `in_draft` [B, T] bool (the full-vocab argmax is in the draft vocab)."""
    values: torch.Tensor
    ids: torch.Tensor
    in_draft: torch.Tensor

    def logits(self, vocab: int) -> torch.Tensor:
        """Dense [B, T, vocab] teacher logits (`sparse_teacher_logits`)."""
        return sparse_teacher_logits(self.values, self.ids, vocab)
