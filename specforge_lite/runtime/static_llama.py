"""A static-cache forward for Llama-family targets (`StaticLlama`).

Hugging Face's forward is general: every call builds masks and cache objects and walks
output dataclasses, and its products run eager kernels that on a CPU are slow at the
widths speculative decoding uses (2-9 rows). `StaticLlama` does only the arithmetic,
on the same weights (q/k/v and gate/up fused into one product each):

- the KV cache is one preallocated buffer per layer written in place at explicit
  positions, so rejecting drafts is a change of one integer (`fast_engine.FastRunner.crop`);
- attention spans a window of the cache, its first slots up to the newest position
  rounded up to WINDOW_STEP (`StaticLlama.window`), under a mask built from the
  positions; the window's length is the one dynamic size of a compiled graph, so one
  graph per width serves every decoding step of that width and no step reads the
  unused end of the cache (docs/BENCHMARKS.md "Batched sampling");
- rotary tables come from the model's own rotary module (every RoPE variant
  transformers implements), computed once for the cache length.

Supported: `llama`, `mistral` (its sliding window on every layer: the cache keeps every
position and the mask hides those the window left), `qwen2` (q/k/v biases), `qwen3`
(per-head q/k RMS norms before the rotary, attention biases where its config has them) and `qwen3_moe` (the same attention; experts behind a top-k router, each
token's experts gathered by index at decoding widths, one expert at a time over a prefill)
with the SiLU MLP; `unsupported_reason(config)` says why not otherwise, and the engine then
keeps Hugging Face's forward.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge_lite.runtime.hf_runner import sliding_windows

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
# attention windows grow in steps of this many cache slots (a multiple of SIMD widths and >= 2,
# which dynamo would otherwise specialise on)
WINDOW_STEP = 16


def unsupported_reason(config) -> str | None:
    """None when `StaticLlama` can run a model with this HF config, else why not."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model_type {kind!r} (the static forward covers {', '.join(SUPPORTED_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if sliding_window(config) is None and sliding_windows(config):
        return "sliding-window layers beside full-attention ones"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    return None


def sliding_window(config) -> int | None:
    """The window every layer attends over (Mistral's `sliding_window`, a Qwen2 with
    `use_sliding_window` on every layer), or None: no window, or one only some layers have."""
    windows = sliding_windows(config)
    types = getattr(config, "layer_types", None)
    if not windows or (types is not None and set(types) != {"sliding_attention"}):
        return None
    (window,) = windows.values()
    return window


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach().contiguous(), requires_grad=False)


class _Layer(nn.Module):
    def __init__(self, layer, capacity: int, num_kv_heads: int, head_dim: int, dtype, device, batch: int = 1):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = _frozen(layer.input_layernorm.weight)
        self.post_norm = _frozen(layer.post_attention_layernorm.weight)
        self.qkv = _frozen(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        self.qkv_bias = None
        if attn.q_proj.bias is not None:
            self.qkv_bias = _frozen(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        self.o = _frozen(attn.o_proj.weight)
        self.o_bias = _frozen(attn.o_proj.bias) if attn.o_proj.bias is not None else None
        # Qwen3: RMS norms over each head's query and key, before the rotary
        self.q_norm = _frozen(attn.q_norm.weight) if hasattr(attn, "q_norm") else None
        self.k_norm = _frozen(attn.k_norm.weight) if hasattr(attn, "k_norm") else None
        self.experts = hasattr(mlp, "experts")  # Qwen3-MoE's sparse layers (its others are dense)
        if self.experts:
            self.router = _frozen(mlp.gate.weight)  # [E, H]
            self.top_k, self.norm_top_k = mlp.gate.top_k, mlp.gate.norm_topk_prob
            self.gate_up = _frozen(mlp.experts.gate_up_proj)  # [E, 2I, H]
            self.down = _frozen(mlp.experts.down_proj)  # [E, H, I]
        else:
            self.gate_up = _frozen(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            self.down = _frozen(mlp.down_proj.weight)
        # WINDOW_STEP spare slots, never used: a window then always slices the cache strictly, and
        # dynamo does not specialise the one graph to (or away from) the whole-cache window
        shape = (batch, num_kv_heads, capacity + WINDOW_STEP, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)


class StaticLlama(nn.Module):
    """The target's forward over t new tokens at explicit cache positions.

    forward(ids [t], positions [t]) writes the tokens' keys and values at `positions`,
    attends over every cache slot at or before each token's position (within `window`:
    `self.window(n)` = slots 0..n-1 rounded up, n > every position; None = the whole
    cache), and returns
    logits [t, V] and the hidden states [t, H] of `hidden_layers` (transformers'
    numbering: 0 = embeddings, i = output of decoder layer i, the last index after the
    final norm) in that order.

    Built with `batch` > 1 it runs B left-padded rows at once (batched sampling):
    forward(ids [B, t], positions [t], start [B]) where row b's real tokens begin at slot
    start[b]; its rotary positions count from there, its queries never see the slots
    before it (a padding query sees only itself, which keeps its row finite), and the
    outputs are [B, t, V] / [B, t, H]. `last_only` keeps only the last position's logits.
    """

    def __init__(self, model, capacity: int, hidden_layers: Iterable[int] = (), batch: int = 1):
        super().__init__()
        config = model.config
        reason = unsupported_reason(config)
        if reason:
            raise ValueError(f"the static forward does not support {reason}")
        inner = model.model
        weight = model.lm_head.weight
        dtype, device = weight.dtype, weight.device
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.capacity = capacity
        self.batch = batch
        self.sliding = sliding_window(config)  # a key older than this many positions is not attended
        self.hidden_layers = tuple(hidden_layers)
        self.embed = _frozen(inner.embed_tokens.weight)
        self.final_norm = _frozen(inner.norm.weight)
        self.lm_head = _frozen(weight)
        self.layers = nn.ModuleList(_Layer(layer, capacity, self.num_kv_heads, self.head_dim, dtype, device, batch)
                                    for layer in inner.layers)
        with torch.no_grad():
            slots = torch.arange(capacity, device=device)
            cos, sin = inner.rotary_emb(torch.zeros(1, dtype=dtype, device=device), slots[None])
        self.register_buffer("slots", slots, persistent=False)
        self.register_buffer("cos", cos[0].to(dtype), persistent=False)
        self.register_buffer("sin", sin[0].to(dtype), persistent=False)
        with torch.inference_mode():  # views of it are graph inputs, made where the decoders run
            self._window_ids = torch.arange(capacity, device=device)

    def _heads(self, layer: _Layer, qkv: torch.Tensor, b: int, t: int):
        """q [b, heads, t, d], k and v [b, kv_heads, t, d] from the fused product (q and k
        RMS-normed per head where the family norms them, as Qwen3 does)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[..., :q_size].view(b, t, self.num_heads, self.head_dim)
        k = qkv[..., q_size:q_size + kv_size].view(b, t, self.num_kv_heads, self.head_dim)
        v = qkv[..., q_size + kv_size:].view(b, t, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def window(self, length: int) -> torch.Tensor:
        """The attention window for forwards whose positions are all below `length`: slot
        ids 0..n-1, n = `length` rounded up to WINDOW_STEP (at most the capacity). A compile
        example needs a window shorter than the cache: a whole-cache one fixes the length."""
        return self._window_ids[:min(self.capacity, -(-max(length, 1) // WINDOW_STEP) * WINDOW_STEP)]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, start: torch.Tensor | None = None,
                last_only: bool = False, window: torch.Tensor | None = None,
                caches: list[torch.Tensor] | tuple[torch.Tensor, ...] | None = None,
                write_at: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None):
        """`write_at` [t] / `tree_mask` [t, span]: a draft tree's verify (batch 1): the keys go
        to slots `write_at` instead of `positions` (rotary only) and row r attends to the
        slots where tree_mask[r] is True (`decoding/tree.verify_layout`)."""
        single = ids.dim() == 1
        if single:
            ids = ids[None]
        b, t = ids.shape
        q_size = self.num_heads * self.head_dim
        slots = self.slots if window is None else window
        span = slots.shape[0]
        visible = slots[None, :] <= positions[:, None] if tree_mask is None else tree_mask  # [t, span]
        write_at = positions if write_at is None else write_at
        if start is None:
            cos, sin = self.cos[positions], self.sin[positions]
        else:
            rotary = (positions[None, :] - start[:, None]).clamp(min=0)  # [B, t]
            cos, sin = self.cos[rotary][:, None], self.sin[rotary][:, None]
            own = slots[None, None, :] >= start[:, None, None]  # [B, 1, span]
            visible = (visible[None] & (own | (slots[None, :] == positions[:, None])[None]))[:, None]
        if self.sliding is not None:  # slots are positions here (a tree's nodes sit after the context)
            visible = visible & (slots[None, :] > positions[:, None] - self.sliding)
        x = F.embedding(ids, self.embed)
        hidden = [x] if 0 in self.hidden_layers else []
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q, k, v = self._heads(layer, qkv, b, t)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            k_cache, v_cache = (layer.k_cache, layer.v_cache) if caches is None else caches[2 * i:2 * i + 2]
            k_cache.index_copy_(2, write_at, k)
            v_cache.index_copy_(2, write_at, v)
            keys, values = k_cache[:, :, :span], v_cache[:, :, :span]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible,
                                                  enable_gqa=self.num_kv_heads != self.num_heads)
            x = x + F.linear(attn.transpose(1, 2).reshape(b, t, q_size), layer.o, layer.o_bias)
            x = x + mlp(layer, rms_norm(x, layer.post_norm, self.eps))
            if i + 1 in self.hidden_layers and i + 1 != self.num_layers:
                hidden.append(x)
        if last_only:
            x = x[:, -1:]
        x = rms_norm(x, self.final_norm, self.eps)
        if self.num_layers in self.hidden_layers:
            hidden.append(x)
        logits = F.linear(x, self.lm_head)
        if single:
            return logits[0], [h[0] for h in hidden]
        return logits, hidden

    @torch.inference_mode()
    def prefill_rows(self, rows: list[list[int]]) -> torch.Tensor:
        """Prefill a batch of prompts left-aligned to a common end, as `forward` with
        `start` lays them out (row b at slots width - len(b) .. width - 1, rotary positions
        from 0), without computing the padding: the rows run as one packed sequence through
        the products, and attention runs per row, causal over its own tokens. Returns the
        logits of each row's last token [B, V]."""
        if len(rows) != self.batch or not all(rows):
            raise ValueError(f"prefill_rows takes {self.batch} non-empty rows, got {len(rows)}")
        lengths = [len(row) for row in rows]
        width = max(lengths)
        if width > self.capacity:
            raise ValueError(f"a prompt of {width} tokens does not fit the static cache of {self.capacity}")
        device = self.lm_head.device
        ids = torch.tensor([token for row in rows for token in row], device=device)[None]  # [1, N]
        rotary = torch.cat([torch.arange(n, device=device) for n in lengths])
        cos, sin = self.cos[rotary], self.sin[rotary]
        ends = torch.tensor(lengths).cumsum(0).tolist()
        spans = list(zip([0] + ends[:-1], ends))
        q_size = self.num_heads * self.head_dim
        n = ids.shape[1]
        x = F.embedding(ids, self.embed)
        masks = [self._row_mask(hi - lo, device) for lo, hi in spans]  # the same in every layer
        for layer in self.layers:
            h = rms_norm(x, layer.input_norm, self.eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q, k, v = self._heads(layer, qkv, 1, n)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            parts = []
            for b, (lo, hi) in enumerate(spans):
                layer.k_cache[b, :, width - (hi - lo):width] = k[0, :, lo:hi]
                layer.v_cache[b, :, width - (hi - lo):width] = v[0, :, lo:hi]
                parts.append(F.scaled_dot_product_attention(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi],
                                                            is_causal=self.sliding is None,
                                                            attn_mask=masks[b],
                                                            enable_gqa=self.num_kv_heads != self.num_heads))
            attn = torch.cat(parts, dim=2)
            x = x + F.linear(attn.transpose(1, 2).reshape(1, n, q_size), layer.o, layer.o_bias)
            x = x + mlp(layer, rms_norm(x, layer.post_norm, self.eps))
        last = x[0, [hi - 1 for _, hi in spans]]
        return F.linear(rms_norm(last, self.final_norm, self.eps), self.lm_head)

    def _row_mask(self, n: int, device) -> torch.Tensor | None:
        """A prefill row's causal mask within the sliding window (None without a window)."""
        if self.sliding is None:
            return None
        i = torch.arange(n, device=device)
        return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.sliding)


def mlp(layer: _Layer, h: torch.Tensor) -> torch.Tensor:
    """The layer's SiLU-gated MLP, or its experts: each token's top-k experts by the router's
    softmax (renormalised over the k where the family says so), their outputs weighted and
    summed. In a compiled graph and at decoding widths (tokens x k at most the experts) the chosen
    experts' weights are gathered by index (shapes that do not depend on the choice); over an
    eager prefill each expert runs once on the tokens that chose it."""
    if not layer.experts:
        gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)
    shape, flat = h.shape, h.reshape(-1, h.shape[-1])
    probs = torch.softmax(F.linear(flat, layer.router), dim=-1, dtype=torch.float)
    weights, chosen = torch.topk(probs, layer.top_k, dim=-1)  # [N, k]
    if layer.norm_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(h.dtype)
    experts = layer.gate_up.shape[0]
    if torch.compiler.is_compiling() or flat.shape[0] * layer.top_k <= experts:  # a graph: one path, any width
        gate, up = torch.einsum("nh,nkjh->nkj", flat, layer.gate_up[chosen]).chunk(2, dim=-1)
        out = torch.einsum("nkj,nkhj->nkh", F.silu(gate) * up, layer.down[chosen])
        return (out * weights[..., None]).sum(dim=1).reshape(shape)
    out = torch.zeros_like(flat)
    for expert in chosen.unique().tolist():
        rows, slot = torch.where(chosen == expert)
        gate, up = F.linear(flat[rows], layer.gate_up[expert]).chunk(2, dim=-1)
        part = F.linear(F.silu(gate) * up, layer.down[expert]) * weights[rows, slot, None]
        out.index_add_(0, rows, part)
    return out.reshape(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
