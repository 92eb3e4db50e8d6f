"""Which dtype a CPU target decodes in when `target.dtype=auto`: float32 unless the CPU computes
bf16 natively, in which case both are timed here and bf16 is kept only where it is faster by more
than the noise of that timing can make (`width_timing`'s rule; float32 is the default because it
is exact, and bf16 rounding changes greedy answers).

Whether bf16 pays is the machine's to say: CPUs without bf16 instructions emulate it, while
with bf16 dot-product or matrix units (AVX512-BF16, AMX, Arm's BF16) it depends on the width and
the thread count (docs/BENCHMARKS.md, sections `dtype_choice_xeon_amx` and `dtype_choice_xeon_amx_16t`).
The forward timed is the one the run decodes with: evaluate's compiled package where it compiles
(`CompiledShape`), else our eager static forward (Hugging Face's where that does not cover the model).
"""

from __future__ import annotations

import copy
import logging
import platform
from pathlib import Path
from typing import Iterable, NamedTuple

import torch

from specforge_lite.runtime.fast_engine import FastEngine
from specforge_lite.runtime.hf_runner import TargetRunner
from specforge_lite.runtime.static_llama import unsupported_reason
from specforge_lite.runtime.width_timing import MARGIN_RULE, keep_or_replace, time_forwards, timing_line

log = logging.getLogger(__name__)

# /proc/cpuinfo flags of the instructions that compute bf16 products natively (x86; Arm's is `bf16`)
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel lists them (x86 `flags`, Arm `Features`); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product or matrix instructions, read from its flags (oneDNN's
    own bf16 check also says yes for AVX-512 CPUs that only emulate bf16)."""
    flags = cpu_flags()
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return any(flag in flags for flag in X86_BF16_FLAGS)


class CompiledShape(NamedTuple):
    """The compiled engine a run will build (`FastEngine`'s capacity, hidden layers and widest forward):
    timed in that shape its package is the one the run's own compile then loads from the graph cache."""
    capacity: int
    hidden_layers: tuple = ()
    max_width: int = 1


def _timed_runner(model, widths: list[int], compiled: CompiledShape | None) -> tuple:
    """`(runner, what it runs)`: the compiled package of `compiled`'s shape (kept in the graph cache),
    else our eager static forward, else Hugging Face's where ours does not cover the model."""
    if unsupported_reason(model.config):
        return TargetRunner(model), "hf"
    if compiled is not None:
        engine = FastEngine(model, compiled.capacity, compiled.hidden_layers, compiled.max_width, compiled=True)
        try:
            engine.compile()
            # each width on the forward that serves it in the run: the graph, or the eager module where faster
            eager = [w for w, forward in engine.route_widths(widths)["serves"].items() if forward == "eager"]
            return engine.runner(), (f"compiled (capacity {engine.capacity}, widths 1..{compiled.max_width})"
                                     + (f", eager at width {', '.join(map(str, eager))}" if eager else ""))
        except Exception as error:  # no C++ compiler, an inductor limitation: the eager forward decides
            log.warning("target.dtype=auto: compiling the target to time it failed (%s: %s); timing the eager "
                        "static forward", type(error).__name__, str(error).splitlines()[0][:200])
    return FastEngine(model, -(-(64 + max(widths)) // 64) * 64, max_width=max(widths)).runner(), "static (eager)"


def choose_cpu_dtype(model, widths: Iterable[int], rounds: int = 5, native: bool | None = None,
                     compiled: CompiledShape | None = None) -> tuple:
    """`(model, info)`: `model` (loaded in float32 for `target.dtype=auto`) or its bf16 copy.
    Forwards of `widths` tokens (1 and the widest verification) are timed in both dtypes in
    interleaved rounds (`width_timing.time_forwards`), on the compiled package of `compiled`'s
    shape where the run compiles, else eagerly; bf16 is kept only when clearly faster
    (`width_timing.keep_or_replace`, float32 the default). A CPU without native bf16 keeps
    float32 without timing. `info` is what the report's `settings.engine.dtype` records: the
    choice, why, the forward timed, the timings in ms per forward, their noise and the rule."""
    native = native_bf16() if native is None else native
    widths = sorted({1, *(int(w) for w in widths)})
    info = {"requested": "auto", "native_bf16": native, "measured_ms": {}, "widths": widths}
    if model.device.type != "cpu" or model.dtype != torch.float32:
        info.update(used=str(model.dtype).removeprefix("torch."), reason="not a float32 CPU target")
        return model, info
    if not native:
        info.update(used="float32", reason="this CPU has no native bf16 instructions (bf16 would be emulated)")
        log.info("target.dtype=auto: float32 (%s)", info["reason"])
        return model, info
    low = copy.deepcopy(model).to(torch.bfloat16).eval()
    runners, timed = {}, {}
    for name, candidate in (("float32", model), ("bfloat16", low)):
        runners[name], timed[name] = _timed_runner(candidate, widths, compiled)
    vocab = model.config.vocab_size
    context_len = max(1, min(64, compiled.capacity - max(widths))) if compiled else 64
    context = torch.randint(0, vocab, (context_len,), generator=torch.Generator().manual_seed(0)).tolist()
    timing = time_forwards(runners, context, widths, rounds)
    used = keep_or_replace(timing, "float32")
    info.update(used=used, measured_ms=timing["ms"], noise=timing["noise"], rounds=rounds,
                timed_forward=timed, margin_rule=MARGIN_RULE,
                reason=("bf16 clearly faster" if used == "bfloat16" else "bf16 not clearly faster")
                + f" on this CPU (ms per forward of widths {'/'.join(map(str, widths))}: {timing_line(timing)})")
    log.info("target.dtype=auto: %s, %s", used, info["reason"])
    del runners
    if used == "bfloat16":
        return low, info
    del low
    return model, info


def chosen_dtype(target_cfg, model, widths: Iterable[int], engine=None, capacity: int | None = None,
                 max_width: int = 1, hidden_layers: Iterable[int] = ()) -> tuple:
    """`(model, what chose its dtype)`: with `target.dtype=auto` on a CPU, float32 or its bf16 copy
    (`choose_cpu_dtype`); a dtype the user named is kept as loaded. engine: the run's eval.engine;
    where it compiles (compiled, auto) the dtypes are timed on the package `build_target_engine`
    builds for `capacity`, `max_width` and the `hidden_layers` its drafters read (so that the run's own
    compile loads the chosen dtype's package)."""
    requested = str(getattr(target_cfg.dtype, "value", target_cfg.dtype))
    if requested != "auto" or model.device.type != "cpu":
        return model, {"requested": requested, "used": str(model.dtype).removeprefix("torch."),
                       "reason": f"target.dtype={requested}" if requested != "auto" else "bf16 on a GPU"}
    compiles = str(getattr(engine, "value", engine)) in ("compiled", "auto")
    shape = (CompiledShape(capacity or model.config.max_position_embeddings, tuple(hidden_layers), max_width)
             if compiles else None)
    return choose_cpu_dtype(model, widths, compiled=shape)


def timed_choice(target_cfg, model) -> bool:
    """Whether `chosen_dtype` would time the two dtypes here (its answer may then differ between
    processes), rather than follow a rule (a named dtype, a GPU, a CPU without native bf16)."""
    requested = str(getattr(target_cfg.dtype, "value", target_cfg.dtype))
    return requested == "auto" and model.device.type == "cpu" and model.dtype == torch.float32 and native_bf16()
