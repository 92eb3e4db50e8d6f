"""The distilled draft model: a small causal LM sharing the target's tokenizer (a copy of
the target's first layers, or any HF model), trained on the target's soft labels.

The drafter contract (`specforge_lite.contract.DrafterModule`):
`options`, `model`, `train`, `decode`, `export` (vLLM's `draft_model`: a plain HF folder).
"""

from __future__ import annotations

import copy

import torch

from specforge_lite import SpecforgeError
from specforge_lite.contract import DrySize
from specforge_lite.drafters.distilled.decode import decoder
from specforge_lite.drafters.distilled.export import export
from specforge_lite.drafters.distilled.options import DistilledOptions as Options
from specforge_lite.drafters.distilled.train import (NAME, batch_preparer, build, describe, layout, load,
                                                     loss_and_metrics, save, target_layers, trained_weights)

UNTRACKED_OPTIONS: tuple[str, ...] = ("simulated_k",)  # only what the training log reports
SERVING_NOTE = None
VLLM_SERVING = ("draft_model", "draft_model")  # vLLM speculative method, export subfolder
LLAMACPP_SERVING = ("DRAFT_SIMPLE", "draft_model.gguf")  # llama.cpp speculative type, draft GGUF
READS_LAST_HIDDEN = True  # its soft labels come from the target's last hidden state


def dry_size(cfg, target_config, batch: int, seq: int) -> DrySize:
    """The student's own config (a known id or local dir) or a truncated target, on the meta
    device. Activations: student layers (bf16 autocast, SDPA attention) and full-vocab
    logits; the teacher's logits and log-probabilities in fp32; LoRA keeps the base bf16."""
    from transformers import AutoModelForCausalLM

    from specforge_lite.targets.loading import sizing_config as read_config

    dcfg = cfg.drafter
    if dcfg.student:
        student_config = read_config(dcfg.student)
        if student_config.vocab_size != target_config.vocab_size:
            raise SpecforgeError(f"drafter.student={dcfg.student} has vocab {student_config.vocab_size}, the target "
                                 f"{target_config.vocab_size}: a draft model must share the target's vocabulary")
    else:
        student_config = copy.deepcopy(target_config)
        student_config.num_hidden_layers = dcfg.student_layers
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(student_config)
    total = sum(p.numel() for p in student.parameters())
    params = total
    if dcfg.lora:
        targets = set(dcfg.lora_target_modules)
        params = sum(dcfg.lora_rank * (m.in_features + m.out_features) for name, m in student.named_modules()
                     if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)
    source = dcfg.student or f"first {dcfg.student_layers} target layers"
    sc, vocab = student.config, target_config.vocab_size
    return DrySize(
        trainable_params=params,
        facts={"student": source, "student_params_b": total / 1e9, "lora": bool(dcfg.lora)},
        line=(f"  draft model {source}: {total / 1e9:.2f}B parameters, {params / 1e6:.1f}M trainable"
              + (f" (LoRA rank {dcfg.lora_rank})" if dcfg.lora else " (full fine-tuning)")),
        activation_bytes=(sc.num_hidden_layers * batch * seq * (16 * sc.hidden_size + 3 * sc.intermediate_size) * 2
                          + batch * seq * vocab * 4 * 3),
        target_logits_bytes=batch * seq * vocab * 4 * 2,
        frozen_bytes=total * 2 if dcfg.lora else 0)


__all__ = ["NAME", "Options", "UNTRACKED_OPTIONS", "SERVING_NOTE", "VLLM_SERVING", "LLAMACPP_SERVING",
           "READS_LAST_HIDDEN", "build", "target_layers", "batch_preparer",
           "loss_and_metrics", "trained_weights", "describe", "save", "load", "layout", "decoder", "export", "dry_size"]
