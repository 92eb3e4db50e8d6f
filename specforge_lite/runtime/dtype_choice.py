"""Which dtype a CPU target decodes in when `target.dtype=auto`: float32 unless the CPU computes
bf16 natively, in which case both are timed here and the faster one is kept.

Whether bf16 pays is the machine's to say: CPUs without bf16 instructions emulate it, while
with bf16 dot-product or matrix units (AVX512-BF16, AMX, Arm's BF16) it depends on the width and
the thread count (docs/BENCHMARKS.md, sections `dtype_choice_xeon_amx` and `dtype_choice_xeon_amx_16t`).
"""

from __future__ import annotations

import copy
import logging
import platform
from pathlib import Path
from typing import Iterable

import torch

from specforge_lite.runtime.fast_engine import FastEngine
from specforge_lite.runtime.hf_runner import TargetRunner
from specforge_lite.runtime.static_llama import unsupported_reason
from specforge_lite.runtime.target_choice import _median_forward_s

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


def _forward_ms(model, widths: list[int], repeats: int) -> dict[int, float]:
    """ms per forward of each width after a 64-token context, on our static forward where it covers
    the model (the compiled engine is its graph), else on Hugging Face's."""
    vocab = model.config.vocab_size
    context = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    if unsupported_reason(model.config):
        runner = TargetRunner(model)
    else:
        runner = FastEngine(model, -(-(64 + max(widths)) // 64) * 64, max_width=max(widths)).runner()
    return {w: round(1e3 * _median_forward_s(runner, context, w, repeats), 3) for w in widths}


def choose_cpu_dtype(model, widths: Iterable[int], repeats: int = 5, native: bool | None = None) -> tuple:
    """`(model, info)`: `model` (loaded in float32 for `target.dtype=auto`) or its bf16 copy,
    whichever runs forwards of `widths` tokens (1 and the widest verification) in less total
    time; a CPU without native bf16 keeps float32 without timing. `info` is what the report's
    `settings.engine.dtype` records: the choice, why, and the timings in ms per forward."""
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
    info["measured_ms"] = {"float32": _forward_ms(model, widths, repeats),
                           "bfloat16": _forward_ms(low, widths, repeats)}
    total = {name: sum(ms.values()) for name, ms in info["measured_ms"].items()}
    used = min(total, key=total.get)
    info.update(used=used, reason=f"the faster of the two on this CPU (ms per forward of widths "
                                  f"{'/'.join(map(str, widths))}: " +
                                  "; ".join(f"{n} " + "/".join(f"{v:.1f}" for v in ms.values())
                                            for n, ms in info["measured_ms"].items()) + ")")
    log.info("target.dtype=auto: %s, %s", used, info["reason"])
    if used == "bfloat16":
        return low, info
    del low
    return model, info


def chosen_dtype(target_cfg, model, widths: Iterable[int]) -> tuple:
    """`(model, what chose its dtype)`: with `target.dtype=auto` on a CPU, float32 or its bf16 copy,
    whichever forwards of `widths` tokens run faster on this machine (`choose_cpu_dtype`);
    a dtype the user named is kept as loaded."""
    requested = str(getattr(target_cfg.dtype, "value", target_cfg.dtype))
    if requested != "auto" or model.device.type != "cpu":
        return model, {"requested": requested, "used": str(model.dtype).removeprefix("torch."),
                       "reason": f"target.dtype={requested}" if requested != "auto" else "bf16 on a GPU"}
    return choose_cpu_dtype(model, widths)
