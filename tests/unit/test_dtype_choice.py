"""target.dtype=auto on a CPU: float32 where the CPU has no native bf16, else the faster of the
two as timed on this machine (runtime/dtype_choice.py)."""

from __future__ import annotations

import platform

import torch
from omegaconf import OmegaConf

from specforge_lite.runtime.dtype_choice import choose_cpu_dtype, chosen_dtype, cpu_flags, native_bf16


def test_a_cpu_without_native_bf16_stays_float32_untimed(tiny_target):
    model, _ = tiny_target
    chosen, info = choose_cpu_dtype(model, [1, 4], native=False)
    assert chosen is model and chosen.dtype == torch.float32
    assert info["used"] == "float32" and info["measured_ms"] == {} and "no native bf16" in info["reason"]


def test_native_bf16_times_both_and_keeps_the_faster(tiny_target):
    model, _ = tiny_target
    chosen, info = choose_cpu_dtype(model, [1, 4], repeats=2, native=True)
    measured = info["measured_ms"]
    assert set(measured) == {"float32", "bfloat16"} and all(set(ms) == {1, 4} for ms in measured.values())
    assert all(v > 0 for ms in measured.values() for v in ms.values())
    faster = min(measured, key=lambda name: sum(measured[name].values()))
    assert info["used"] == faster and str(chosen.dtype) == f"torch.{faster}"
    assert model.dtype == torch.float32  # the loaded target is never cast in place
    if faster == "bfloat16":  # a copy with the same weights, rounded
        for a, b in zip(model.parameters(), chosen.parameters()):
            assert torch.equal(a.to(torch.bfloat16), b)


def test_a_named_dtype_is_used_as_loaded(tiny_target):
    model, _ = tiny_target
    chosen, info = chosen_dtype(OmegaConf.create({"dtype": "float32"}), model, [1, 4])
    assert chosen is model and info == {"requested": "float32", "used": "float32", "reason": "target.dtype=float32"}


def test_native_bf16_reads_the_machine():
    flags = cpu_flags()
    if platform.machine().lower() in ("x86_64", "amd64") and flags:
        assert native_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)
    assert isinstance(native_bf16(), bool)
