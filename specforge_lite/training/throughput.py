"""Per-rank truth of a training run: real tokens, tokens/s per device and an MFU estimate.

MFU is the model FLOPs a rank did per second over its device's bf16 dense peak. The FLOPs
per real token are an estimate, said as such: 6 per trainable drafter parameter per drafter
pass (forward and backward; EAGLE-3 and P-EAGLE run `ttt_steps` passes) plus, online, 2 per
target parameter (the frozen target's forward). The peak comes from `train.peak_tflops` (a
number, or a GPU of `PEAK_BF16_TFLOPS`) or from the device's name; an unknown device has no
peak and prints no MFU.
"""

from __future__ import annotations

import logging

import torch

from specforge_lite import SpecforgeError

log = logging.getLogger(__name__)

# NVIDIA's published bf16 dense (no sparsity) peaks, TFLOP/s
PEAK_BF16_TFLOPS = {
    "h100_sxm": 989.0, "h100_pcie": 756.0, "h100_nvl": 835.0, "h200": 989.0, "gh200": 989.0,
    "a100_40gb": 312.0, "a100_80gb": 312.0, "l40s": 362.0,
}


def gpu_key(device_name: str | None) -> str | None:
    """The table's key for a CUDA device name (`torch.cuda.get_device_name`), or None."""
    name = (device_name or "").lower().replace("-", " ")
    if "gh200" in name:
        return "gh200"
    if "h200" in name:
        return "h200"
    if "h100" in name:
        return "h100_nvl" if "nvl" in name else "h100_pcie" if "pcie" in name else "h100_sxm"
    if "a100" in name:
        return "a100_80gb" if "80gb" in name.replace(" ", "") else "a100_40gb"
    if "l40s" in name:
        return "l40s"
    return None


def peak_tflops(setting, device_name: str | None = None) -> tuple[float | None, str]:
    """(peak TFLOP/s, where it came from) for `train.peak_tflops` (null: the device's name);
    a setting that is neither a positive number nor a GPU of the table is refused."""
    if setting is not None:
        text = str(setting).strip()
        key = text.lower()
        if key in PEAK_BF16_TFLOPS:
            return PEAK_BF16_TFLOPS[key], f"train.peak_tflops={key}"
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or value <= 0:
            raise SpecforgeError(f"train.peak_tflops={text!r}: not a positive TFLOP/s figure nor a known GPU "
                                 f"({', '.join(PEAK_BF16_TFLOPS)})")
        return value, f"train.peak_tflops={value:g}"
    key = gpu_key(device_name)
    if key is None:
        return None, f"no peak known for {device_name or 'this device'} (set train.peak_tflops)"
    return PEAK_BF16_TFLOPS[key], f"{device_name} ({key})"


def flops_per_token(trainable_params: int, drafter_passes: int, target_params: int, target_forward: bool) -> float:
    """Model FLOPs per real token: 6 x trainable x passes for the drafter, 2 x target for its forward."""
    return 6.0 * trainable_params * max(1, drafter_passes) + (2.0 * target_params if target_forward else 0.0)


def rank_report(tokens: list[float], seconds: list[float], idle_steps: list[float], steps: int,
                per_token_flops: float, peak: float | None) -> dict:
    """Per rank: real tokens, busy seconds, tokens/s, MFU (None without a peak) and the steps in
    which it trained on no real token."""
    ranks = []
    for r, (n, s, idle) in enumerate(zip(tokens, seconds, idle_steps)):
        rate = n / s if s > 0 else 0.0
        ranks.append({"rank": r, "real_tokens": int(n), "seconds": round(s, 3), "tokens_per_s": round(rate, 1),
                      "mfu": None if peak is None else round(rate * per_token_flops / (peak * 1e12), 5),
                      "steps_without_real_tokens": int(idle)})
    return {"steps": steps, "flops_per_token": per_token_flops, "peak_tflops": peak, "ranks": ranks,
            "ranks_idle_in_some_step": sum(1 for r in ranks if r["steps_without_real_tokens"])}


def report_lines(report: dict, peak_from: str) -> list[str]:
    lines = []
    for r in report["ranks"]:
        mfu = "MFU none" if r["mfu"] is None else f"MFU {100 * r['mfu']:.1f}%"
        lines.append(f"rank {r['rank']}: {r['real_tokens']} real tokens, {r['tokens_per_s']:.0f} tokens/s, {mfu}, "
                     f"{r['steps_without_real_tokens']} step(s) with no real token")
    lines.append(f"MFU estimate: {report['flops_per_token']:.3g} FLOP per real token over the bf16 peak of "
                 f"{peak_from}" if report["peak_tflops"] is not None else f"MFU: none ({peak_from})")
    return lines


def per_device(cfg, accelerator, rank_counts: dict, busy: float, params, target) -> dict:
    """Every rank's tokens/s and MFU estimate (training/throughput.py), logged on rank 0."""
    seconds = torch.tensor([busy], dtype=torch.float64, device=accelerator.device)
    every = accelerator.gather(seconds).tolist() if accelerator.num_processes > 1 else [busy]
    device = accelerator.device
    peak, peak_from = peak_tflops(cfg.train.peak_tflops, torch.cuda.get_device_name(device)
                                  if device.type == "cuda" else str(device))
    per_token = flops_per_token(sum(p.numel() for p in params), int(cfg.drafter.get("ttt_steps") or 1),
                                sum(p.numel() for p in target.parameters()), cfg.train.mode == "online")
    report = rank_report(rank_counts["tokens_per_rank"], every, rank_counts["idle_steps_per_rank"],
                         rank_counts["steps"], per_token, peak)
    if accelerator.is_main_process:
        for line in report_lines(report, peak_from):
            log.info(line)
    return report
