"""Compiling a module's forward with inductor, and the settings that shape the graphs.

`compile_frozen` builds `torch.compile` graphs (frozen weights, autotuned products) for
the shapes a caller names; `gemm_rows` and `autotune` read the environment switches the
graphs are built with (docs/BENCHMARKS.md "Target forward", engine_autotune).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable, Iterable

import torch.nn as nn

log = logging.getLogger(__name__)

_GRAPHS_ALLOWED = [0]  # graphs asked for so far in this process


def allow_graphs(count: int) -> None:
    """Let dynamo keep `count` more graphs (one per width) of one function: past its limit
    (8 by default) it would silently run the wider widths eagerly. The limit counts every
    graph of a code object, so graphs of two modules of one class (a bench's two engines,
    a target and a draft model) add up."""
    import torch._dynamo.config as dynamo_config

    _GRAPHS_ALLOWED[0] += count
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _GRAPHS_ALLOWED[0] + 8)


# Rows per register block of inductor's fp32 C++ GEMM micro-kernel on AVX-512 CPUs: inductor's
# own 8 or 16 rows are slower than 4 at our decoding widths (k + 1 <= 9) and sampling batches
# (<= 16 rows): docs/BENCHMARKS.md "Target forward" and "Batched sampling".
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
# inductor's default kernels: shorter compiles (the test suite uses it) and slower forwards
# (docs/BENCHMARKS.md engine_autotune).
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
