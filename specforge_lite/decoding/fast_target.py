"""A static-cache forward for Llama-family targets, eager or compiled.

Hugging Face's forward is general: every call builds masks and cache objects and walks
output dataclasses, and its products run eager kernels that on a CPU are slow at the
widths speculative decoding uses (2-9 rows). `StaticLlama` does only the arithmetic,
on the same weights (q/k/v and gate/up fused into one product each):

- the KV cache is one preallocated buffer per layer written in place at explicit
  positions, so rejecting drafts is a change of one integer (`FastRunner.crop`);
- attention spans a window of the cache, its first slots up to the newest position
  rounded up to WINDOW_STEP (`StaticLlama.window`), under a mask built from the
  positions; the window's length is the one dynamic size of a compiled graph, so one
  graph per width serves every decoding step of that width and no step reads the
  unused end of the cache (docs/BENCHMARKS.md "Batched sampling");
- rotary tables come from the model's own rotary module (every RoPE variant
  transformers implements), computed once for the cache length.

`FastEngine` owns one `StaticLlama` for a run and, when compiled, a graph for the
decoding widths 1..max_width. On a CPU that is one AOTInductor package (`torch.export`
with the width and the window dynamic, inductor with frozen, pre-packed weights and
autotuned products), kept on disk under a key of everything it was built from (weights,
shapes, torch, CPU capability, threads, this file), so a later run with the same target
loads it in seconds instead of compiling for minutes (`graph_cache_dir`). On a GPU it is
`torch.compile` graphs per width with CUDA graphs, built each run. Wider forwards (prefill)
run the same module eagerly. (`torch.compile`'s own graph cache skips graphs whose frozen
weights were packed for oneDNN, and without that packing its C++ GEMM template is not used:
hence the package.)

Supported: `llama`, `mistral` without a sliding window, `qwen2` (q/k/v biases) with
the SiLU MLP; `unsupported_reason(config)` says why not otherwise, and the engine
then keeps Hugging Face's forward.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge_lite.decoding import graph_cache
from specforge_lite.decoding.graph_cache import GRAPH_CACHE_ENV, graph_cache_dir  # noqa: F401  (their old home)

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
# attention windows grow in steps of this many cache slots (a multiple of SIMD widths and >= 2,
# which dynamo would otherwise specialise on)
WINDOW_STEP = 16
ENGINES = ("auto", "compiled", "static", "hf")


def unsupported_reason(config) -> str | None:
    """None when `StaticLlama` can run a model with this HF config, else why not."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model_type {kind!r} (the static forward covers {', '.join(SUPPORTED_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "a sliding attention window"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    return None


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

    def window(self, length: int) -> torch.Tensor:
        """The attention window for forwards whose positions are all below `length`: slot
        ids 0..n-1, n = `length` rounded up to WINDOW_STEP (at most the capacity). A compile
        example needs a window shorter than the cache: a whole-cache one fixes the length."""
        return self._window_ids[:min(self.capacity, -(-max(length, 1) // WINDOW_STEP) * WINDOW_STEP)]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, start: torch.Tensor | None = None,
                last_only: bool = False, window: torch.Tensor | None = None,
                caches: list[torch.Tensor] | tuple[torch.Tensor, ...] | None = None):
        single = ids.dim() == 1
        if single:
            ids = ids[None]
        b, t = ids.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        slots = self.slots if window is None else window
        span = slots.shape[0]
        visible = slots[None, :] <= positions[:, None]  # [t, span]
        if start is None:
            cos, sin = self.cos[positions], self.sin[positions]
        else:
            rotary = (positions[None, :] - start[:, None]).clamp(min=0)  # [B, t]
            cos, sin = self.cos[rotary][:, None], self.sin[rotary][:, None]
            own = slots[None, None, :] >= start[:, None, None]  # [B, 1, span]
            visible = (visible[None] & (own | (slots[None, :] == positions[:, None])[None]))[:, None]
        x = F.embedding(ids, self.embed)
        hidden = [x] if 0 in self.hidden_layers else []
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, self.eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q = qkv[..., :q_size].view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
            k = qkv[..., q_size:q_size + kv_size].view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = qkv[..., q_size + kv_size:].view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k_cache, v_cache = (layer.k_cache, layer.v_cache) if caches is None else caches[2 * i:2 * i + 2]
            k_cache.index_copy_(2, positions, k)
            v_cache.index_copy_(2, positions, v)
            keys, values = k_cache[:, :, :span], v_cache[:, :, :span]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible,
                                                  enable_gqa=self.num_kv_heads != self.num_heads)
            x = x + F.linear(attn.transpose(1, 2).reshape(b, t, q_size), layer.o)
            h = _rms_norm(x, layer.post_norm, self.eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
            if i + 1 in self.hidden_layers and i + 1 != self.num_layers:
                hidden.append(x)
        if last_only:
            x = x[:, -1:]
        x = _rms_norm(x, self.final_norm, self.eps)
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
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        n = ids.shape[1]
        x = F.embedding(ids, self.embed)
        for layer in self.layers:
            h = _rms_norm(x, layer.input_norm, self.eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q = qkv[..., :q_size].view(1, n, self.num_heads, self.head_dim).transpose(1, 2)
            k = qkv[..., q_size:q_size + kv_size].view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = qkv[..., q_size + kv_size:].view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            parts = []
            for b, (lo, hi) in enumerate(spans):
                layer.k_cache[b, :, width - (hi - lo):width] = k[0, :, lo:hi]
                layer.v_cache[b, :, width - (hi - lo):width] = v[0, :, lo:hi]
                parts.append(F.scaled_dot_product_attention(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi],
                                                            is_causal=True,
                                                            enable_gqa=self.num_kv_heads != self.num_heads))
            attn = torch.cat(parts, dim=2)
            x = x + F.linear(attn.transpose(1, 2).reshape(1, n, q_size), layer.o)
            h = _rms_norm(x, layer.post_norm, self.eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        last = x[0, [hi - 1 for _, hi in spans]]
        return F.linear(_rms_norm(last, self.final_norm, self.eps), self.lm_head)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


_GRAPHS_ALLOWED = [0]  # graphs asked for so far in this process


def allow_graphs(count: int) -> None:
    """Let dynamo keep `count` more graphs (one per width) of one function: past its limit
    (8 by default) it would silently run the wider widths eagerly. The limit counts every
    graph of a code object, so graphs of two modules of one class (a bench's two engines,
    a target and a draft model) add up."""
    import torch._dynamo.config as dynamo_config

    _GRAPHS_ALLOWED[0] += count
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _GRAPHS_ALLOWED[0] + 8)


# Rows per register block of inductor's fp32 C++ GEMM micro-kernel on AVX-512 CPUs. Inductor
# picks 8 (or 16) rows there, and on a 2-core AVX-512 CPU that made SmolLM2's forwards of 5-9
# tokens 1.2-1.8x slower and its batch-16 sampling step 1.3-1.4x slower than 4-row blocks
# (docs/BENCHMARKS.md "Target forward", "Batched sampling"). Our decoding widths (k + 1 <= 9)
# and sampling batches (<= 16 rows) sit exactly there.
# SPECFORGE_LITE_GEMM_ROWS=0 keeps inductor's own choice; any other value sets the rows.
GEMM_ROWS_ENV = "SPECFORGE_LITE_GEMM_ROWS"
DEFAULT_GEMM_ROWS = 4


def gemm_rows() -> int:
    """The rows per register block `compile_frozen` asks of inductor's fp32 AVX-512 GEMM
    micro-kernel (0: inductor's own choice)."""
    value = os.environ.get(GEMM_ROWS_ENV, "").strip()
    if not value:
        return DEFAULT_GEMM_ROWS
    if not value.isdigit() or int(value) > 16:
        raise ValueError(f"{GEMM_ROWS_ENV}={value!r}: expected 0 (inductor's choice) or rows 1..16")
    return int(value)


# Whether compiled graphs autotune their matrix products (inductor's max-autotune: each product
# timed over its candidate kernels, the C++ GEMM micro-kernel among them on a CPU). On by
# default: the decoding forwards are what evaluate measures. SPECFORGE_LITE_AUTOTUNE=0 keeps
# inductor's default kernels: shorter compiles (three compile tests of the tiny test models,
# test_compiled_forward_equals_transformers, test_compiled_graph_is_kept_and_loaded_by_a_later_engine
# and EAGLE-3's test_compiled_drafting_equals_eager_drafting: 407 s autotuned, 138 s without, on a
# 2-core AVX2 CPU, pytest --durations) and slower forwards (SmolLM2 on that CPU: 36.5 against
# 23.6 ms for one token, 1.09-1.37x slower at 2-5: docs/BENCHMARKS.md engine_autotune).
AUTOTUNE_ENV = "SPECFORGE_LITE_AUTOTUNE"


def autotune() -> bool:
    """Whether `compile_frozen` and the kept packages autotune every matrix product."""
    value = os.environ.get(AUTOTUNE_ENV, "").strip().lower()
    if value in ("", "1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{AUTOTUNE_ENV}={value!r}: expected 1 (autotune every product, the default) "
                     "or 0 (inductor's default kernels)")


@contextlib.contextmanager
def env_setting(name: str, value: str):
    """While active, the environment variable `name` is `value` (the settings above are read
    from the environment when graphs are built); restored on exit."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def inductor_gemm_rows():
    """While active, `compile_frozen` keeps inductor's own GEMM register blocks (as
    SPECFORGE_LITE_GEMM_ROWS=0 does)."""
    return env_setting(GEMM_ROWS_ENV, "0")


class _GemmRows:
    """While active, inductor's fp32 micro-kernel for AVX-512 uses register blocks of `rows`
    rows x 48 columns instead of its own (8 x 48, 8 x 32, 16 x 16). A no-op for rows = 0, on
    other ISAs and dtypes, and where this torch's inductor does not have the structures it
    edits (then it logs why)."""

    def __init__(self, rows: int):
        self.rows, self.saved = rows, None

    def __enter__(self):
        if not self.rows:
            return self
        try:
            import torch._inductor.compile_fx  # noqa: F401  (loads the codegen package in its order)
            from torch._inductor.codegen import cpp_micro_gemm as micro

            kernel, isa, configs = micro.CppMicroGemmFP32Vec, micro.VecAVX512, micro.micro_gemm_configs
            make, blocking = micro.CppMicroGemmConfig, micro.GemmBlocking
        except (ImportError, AttributeError) as exc:
            log.info("inductor's GEMM micro-kernel rows stay its own (%s)", exc)
            return self
        fp32 = torch.float32

        def ours(config) -> bool:
            return (config.vec_isa_cls is isa and config.extra_check is None
                    and (config.input_dtype, config.input2_dtype, config.output_dtype, config.compute_dtype)
                    == (fp32, fp32, fp32, fp32))

        current = configs.get(kernel, [])
        if not any(ours(c) for c in current):
            return self
        self.saved = (configs, kernel, current)
        configs[kernel] = [c for c in current if not ours(c)] + [make(fp32, fp32, fp32, fp32, isa,
                                                                    blocking(self.rows, 48, 1))]
        return self

    def __exit__(self, *exc):
        if self.saved:
            configs, kernel, current = self.saved
            configs[kernel] = current
            self.saved = None
        return False


def compile_frozen(module: nn.Module, example_calls: Iterable[tuple], dynamic_args: Iterable[int] = ()
                   ) -> tuple[Callable, float]:
    """`module` under `torch.compile` (inductor, every product autotuned unless
    SPECFORGE_LITE_AUTOTUNE=0; CUDA graphs on a GPU),
    with one graph built per call in `example_calls` (argument tuples, one per shape the caller
    will use) now, in inference mode as the decoders call it (dynamo keys graphs on it: a graph
    built outside would be rebuilt, unfrozen, inside the first timed call) and with inductor's
    freezing (weights folded in as constants and pre-packed). On a CPU the C++ GEMM
    micro-kernel uses `gemm_rows()` rows per register block (see DEFAULT_GEMM_ROWS).
    Every shape is static except the first dimension of the tensor arguments at the indices in
    `dynamic_args` (e.g. an attention window that grows with the context): one graph then
    serves every length of it.
    Returns (graph, seconds taken).
    The module's buffers stay state the graphs write in place (KV caches)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    calls, dynamic = list(example_calls), tuple(dynamic_args)
    allow_graphs(len(calls))
    device = next(iter(module.parameters()), torch.empty(0)).device
    tuned = autotune()
    if device.type == "cuda":
        mode = "max-autotune" if tuned else "reduce-overhead"  # both capture CUDA graphs
    else:
        mode = "max-autotune-no-cudagraphs" if tuned else "default"
    graph = torch.compile(module, mode=mode, dynamic=False)
    start = time.perf_counter()
    with torch.inference_mode(), _GemmRows(gemm_rows() if device.type == "cpu" else 0), \
            inductor_config.patch(freezing=True, autotune_num_choices_displayed=0,
                                  max_autotune_report_choices_stats=False):
        for args in calls:
            # inputs made here are inference tensors, as the decoders' are: dynamo guards on it,
            # and an example made outside would leave a graph the first real call rebuilds,
            # unfrozen and untuned, mid-timing
            args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            for i in dynamic:
                torch._dynamo.maybe_mark_dynamic(args[i], 0)  # static where the example is the whole cache
            graph(*args)
    return graph, time.perf_counter() - start


# --------------------------------------------------------------------------- graph packages

# a package serves widths 1..max(this, the engine's max_width): its width is a dynamic size
# (a package of widths 1..5 was as fast as per-width graphs at t = 1-3 and faster at 4-5,
# docs/BENCHMARKS.md engine_avx2), so evaluations at other k up to 15 load the same package
PACKAGE_WIDTHS = 16


class _Exported(nn.Module):
    """`StaticLlama.forward` with the KV caches as inputs (graphs write them in place), the
    shape torch.export wants: a package then holds the weights but not the cache, which the
    engine keeps and every width shares."""

    def __init__(self, module: StaticLlama):
        super().__init__()
        self.module = module

    def forward(self, ids, positions, window, *caches):
        return self.module(ids, positions, None, False, window, caches)


def _caches(module: StaticLlama) -> list[torch.Tensor]:
    return [c for layer in module.layers for c in (layer.k_cache, layer.v_cache)]


def graph_key(module: StaticLlama, max_width: int) -> str:
    """A digest of everything a target package is built from: the weights and rotary tables
    (every byte), the shapes, the source of the files that build it, torch's version, the
    CPU capability inductor compiles for and the thread count its kernels are built for
    (`graph_cache.graph_key`)."""
    facts = {"max_width": max_width, "capacity": module.capacity, "batch": module.batch,
             "hidden_layers": list(module.hidden_layers), "window_step": WINDOW_STEP}
    tensors = [*module.named_parameters(), *[(n, b) for n, b in module.named_buffers() if n in ("cos", "sin")]]
    here = Path(__file__).parent
    return graph_cache.graph_key(facts, tensors, [here / "fast_target.py", here / "graph_cache.py"])


def _export(module: StaticLlama, max_width: int):
    """The forward exported with width 1..max_width and the window length dynamic."""
    from torch.export import Dim, export

    device = module.lm_head.device
    width = min(2, max_width)
    ids = torch.zeros(width, dtype=torch.long, device=device)
    window = module.window(WINDOW_STEP)
    caches = tuple(c.clone() for c in _caches(module))  # not the buffers: export rejects aliased inputs
    width_dim = Dim("width", min=1, max=max_width) if max_width > 1 else None
    dims = ({0: width_dim} if width_dim else None, {0: width_dim} if width_dim else None,
            {0: Dim("window", min=2, max=module.capacity)}, (None,) * len(caches))
    with torch.no_grad():
        return export(_Exported(module), (ids, torch.arange(width, device=device), window, *caches),
                      dynamic_shapes=dims)


def packaged_forward(module: StaticLlama, max_width: int, cache_dir: Path | None
                     ) -> tuple[Callable, float, str]:
    """The module's forward for widths 1..max_width (and up to PACKAGE_WIDTHS) as one
    AOTInductor package: loaded from `cache_dir` when a package built from the same weights,
    shapes and software is there, else compiled (and kept there unless `cache_dir` is None;
    `graph_cache.kept_package`).
    Returns (forward taking the module's arguments, seconds taken, "loaded" or "compiled")."""
    widths = max(max_width, PACKAGE_WIDTHS)
    runner, seconds, how = graph_cache.kept_package("target", graph_key(module, widths),
                                                    lambda: _export(module, widths), cache_dir)
    caches = _caches(module)

    def forward(ids, positions, start=None, last_only=False, window=None):
        if start is not None or last_only or window is None:
            raise ValueError("the packaged forward takes batch-1 ids, positions and a window")
        return runner(ids, positions, window, *caches)

    return forward, seconds, how


class FastEngine:
    """One `StaticLlama` for a run, shared by every method's runner (one decode at a time).

    compiled: forwards of width 1..max_width run compiled graphs (built or loaded by
    `compile()`, before anything is timed); other widths run the module eagerly. On a CPU
    the graphs are one AOTInductor package kept in `cache_dir` (default `graph_cache_dir()`;
    None keeps none); on a GPU, `torch.compile` graphs with CUDA graphs (`packaged=False`
    asks for those on a CPU too: one per width, built each run).
    """

    def __init__(self, model, capacity: int, hidden_layers: Iterable[int] = (), max_width: int = 1,
                 compiled: bool = False, cache_dir: Path | None | str = "default", packaged: bool | None = None):
        self.model = model
        self.num_states = model.config.num_hidden_layers + 1  # embeddings + every layer's output
        self.module = StaticLlama(model, capacity, sorted({layer % self.num_states for layer in hidden_layers})).eval()
        self.device = self.module.lm_head.device
        self.max_width = max_width
        self.compiled = compiled
        self.compile_s: float | None = None
        self.cache_dir = graph_cache.resolve_cache_dir(cache_dir)
        self.graph_source: str | None = None  # "compiled" or "loaded" (from cache_dir)
        self.packaged = self.device.type == "cpu" if packaged is None else packaged
        self._graph = None
        self.length = 0
        self.owner = None  # the runner whose state the cache holds

    @property
    def capacity(self) -> int:
        return self.module.capacity

    def compile(self) -> float:
        """Build (or load) the graphs of widths 1..max_width now; returns the seconds it took."""
        if not self.compiled or self._graph is not None:
            return self.compile_s or 0.0
        if self.packaged:
            graph, self.compile_s, self.graph_source = packaged_forward(self.module, self.max_width, self.cache_dir)
        else:
            with torch.inference_mode():
                widths = [(torch.zeros(w, dtype=torch.long, device=self.device), torch.arange(w, device=self.device),
                           None, False, self.module.window(WINDOW_STEP)) for w in range(1, self.max_width + 1)]
            graph, self.compile_s = compile_frozen(self.module, widths, dynamic_args=(4,))
            self.graph_source = "compiled"
        self._graph = graph
        self.length = 0
        widths = max(self.max_width, PACKAGE_WIDTHS) if self.packaged else self.max_width
        log.info("%s the target's forward for widths 1..%d in %.0f s", self.graph_source, widths, self.compile_s)
        return self.compile_s

    def runner(self, layers: Iterable[int] = ()) -> "FastRunner":
        return FastRunner(self, tuple(layers))

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        width = len(token_ids)
        start = self.length
        if start + width > self.capacity:
            raise RuntimeError(f"the static KV cache holds {self.capacity} positions; this forward needs "
                               f"{start + width} (raise the engine's capacity)")
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + width, device=self.device)
        use_graph = self._graph is not None and width <= self.max_width
        window = self.module.window(start + width)
        logits, hidden = (self._graph if use_graph else self.module)(ids, positions, None, False, window)
        self.length = start + width
        return logits, hidden


class FastRunner:
    """`engine.TargetRunner`'s interface over a `FastEngine`: extends the shared cache."""

    def __init__(self, engine: FastEngine, layers: tuple[int, ...]):
        built = engine.module.hidden_layers
        missing = [layer for layer in layers if layer % engine.num_states not in built]
        if missing:
            raise ValueError(f"the engine was built without hidden layers {missing}")
        self.engine = engine
        self.model = engine.model
        self.device = engine.device
        self.layers = layers  # as the drafter asked (negative ones count from the end)
        self._index = [built.index(layer % engine.num_states) for layer in layers]
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

    def reset(self) -> None:
        self.engine.length = 0
        self.engine.owner = self

    @property
    def length(self) -> int:
        return self.engine.length

    def forward(self, token_ids: list[int], last_only: bool = False
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if self.engine.owner is not self:
            raise RuntimeError("another runner used the shared cache since this one's reset()")
        logits, hidden = self.engine.forward(token_ids)
        if last_only:
            logits = logits[-1:]
        return logits, {layer: hidden[i][None] for layer, i in zip(self.layers, self._index)}

    def crop(self, keep: int) -> None:
        self.engine.length = min(self.engine.length, keep)


# --------------------------------------------------------------------------- choosing

def _median_forward_s(runner, context: list[int], width: int, repeats: int) -> float:
    import statistics

    runner.reset()
    runner.forward(context, last_only=True)
    ids = context[:width]
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        runner.forward(ids)
        runner._sync()
        times.append(time.perf_counter() - start)
        runner.crop(len(context))
    return statistics.median(times[1:])


class TargetForward:
    """The target forward a run decodes with: `runner(layers)` gives each decoder its
    runner; `info` is what choosing it measured (the report's `settings.engine`)."""

    def __init__(self, model, engine: FastEngine | None, info: dict):
        self.model, self.engine, self.info = model, engine, info

    def runner(self, layers: Iterable[int] = ()):
        from specforge_lite.decoding.engine import TargetRunner

        return self.engine.runner(layers) if self.engine is not None else TargetRunner(self.model, layers)


def build_target_engine(model, choice: str, capacity: int, hidden_layers: Iterable[int], max_width: int,
                        repeats: int = 5, cache_dir: Path | None | str = "default") -> TargetForward:
    """The target forward a run decodes with, and what choosing it measured.

    choice: hf (transformers' forward), static (`StaticLlama`, eager), compiled (its
    graphs for widths 1..max_width) or auto: every candidate this model and machine
    can run, timed on widths 1 and max_width after a 64-token context, the one with the
    least total kept. cache_dir: where compiled graphs are kept (`FastEngine`).
    """
    from specforge_lite.decoding.engine import TargetRunner

    info = {"requested": choice, "capacity": capacity, "compile_s": None, "measured_ms": {}, "fallback": None}
    reason = unsupported_reason(model.config)
    if reason:
        if choice in ("static", "compiled"):
            raise ValueError(f"eval.engine={choice}: the static forward does not support {reason}; "
                             "use eval.engine=hf or auto")
        info.update(used="hf", fallback=f"the static forward does not support {reason}")
        return TargetForward(model, None, info)
    if choice == "hf":
        info["used"] = "hf"
        return TargetForward(model, None, info)
    engines = {}
    if choice in ("static", "auto"):
        engines["static"] = FastEngine(model, capacity, hidden_layers, max_width)
    if choice in ("compiled", "auto"):
        engine = FastEngine(model, capacity, hidden_layers, max_width, compiled=True, cache_dir=cache_dir)
        try:
            info["gemm_rows"] = gemm_rows() if engine.device.type == "cpu" else None
            info["autotune"] = autotune()
            info["compile_s"] = engine.compile()
            info["graph"] = engine.graph_source  # compiled this run, or loaded from the cache
            # whether the graphs are kept between runs (not where: a report names no local paths)
            info["graph_cache"] = bool(engine.cache_dir) and engine.packaged
            engines["compiled"] = engine
        except Exception as error:  # no C++ compiler, an inductor limitation: say so, keep the others
            if choice == "compiled":
                raise RuntimeError(f"eval.engine=compiled: compiling the target failed: {error}") from error
            info["fallback"] = f"compiling failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
            log.warning("eval.engine=auto: %s; choosing among the others", info["fallback"])
    if choice != "auto":
        info["used"] = choice
        return TargetForward(model, engines[choice], info)
    vocab = model.config.vocab_size
    context_len = max(1, min(64, capacity - max_width))
    context = torch.randint(0, vocab, (context_len,), generator=torch.Generator().manual_seed(0)).tolist()
    candidates = {"hf": TargetRunner(model), **{name: e.runner() for name, e in engines.items()}}
    for name, runner in candidates.items():
        info["measured_ms"][name] = {w: 1e3 * _median_forward_s(runner, context, w, repeats)
                                     for w in sorted({1, max_width})}
    used = min(info["measured_ms"], key=lambda n: sum(info["measured_ms"][n].values()))
    info["used"] = used
    log.info("eval.engine=auto: %s (ms per forward of width %s: %s)", used, sorted({1, max_width}),
             "; ".join(f"{n} " + "/".join(f"{v:.1f}" for v in ms.values()) for n, ms in info["measured_ms"].items()))
    return TargetForward(model, engines.get(used), info)
