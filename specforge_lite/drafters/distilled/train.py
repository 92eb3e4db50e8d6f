"""Distillation training: build the student, the token-level divergence, the saved folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specforge_lite.drafters.distilled.model import DistillStudent, add_lora, load_student, merged, truncated_student

NAME = "distilled"


def build(cfg, target, token_counts: torch.Tensor) -> DistillStudent:
    """token_counts is unused: a draft model keeps the target's whole vocabulary."""
    from specforge_lite.targets.loading import load_tokenizer

    dcfg = cfg.drafter
    torch.manual_seed(cfg.train.seed)
    if dcfg.student:
        lm = load_student(dcfg.student, target, load_tokenizer(cfg.target))
    else:
        lm = truncated_student(target, dcfg.student_layers)
    lm = lm.to(target.device).train()
    if dcfg.lora:
        lm = add_lora(lm, dcfg)
    student = DistillStudent(lm)
    student.source = dcfg.student or f"first {dcfg.student_layers} layers of the target"
    return student


def describe(student: DistillStudent) -> str:
    base = student.base()
    total = sum(p.numel() for p in base.parameters())
    lora = " with LoRA adapters" if hasattr(student.lm, "merge_and_unload") else ""
    return (f"student {getattr(student, 'source', '?')}{lora}: {base.config.num_hidden_layers} layers, "
            f"{total / 1e6:.1f}M parameters, vocab {base.config.vocab_size}")


def target_layers(student: DistillStudent) -> list[int]:
    return []


def batch_preparer(student: DistillStudent, target):
    """Adds `select` [B, T] (positions whose next token is an assistant token), the target's
    full-vocab logits there (`target_logits` [N, V]) and `num_positions` = N."""
    head = target.get_output_embeddings().weight

    @torch.no_grad()
    def prepare(batch: dict, aux, last: torch.Tensor, own: bool) -> None:
        select = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
        select[:, :-1] = batch["loss_mask"][:, 1:].bool() & own
        batch["select"] = select
        batch["target_logits"] = last[select] @ head.T
        batch["num_positions"] = select.sum().float()

    return prepare


def loss_and_metrics(student, batch: dict, cfg):
    """Summed divergence at the selected positions; metrics: next-token agreement with the
    target and chains of agreeing consecutive positions (up to drafter.simulated_k), from
    which the train stage's simulated acceptance length follows."""
    from specforge_lite.training.losses import LOSSES

    dcfg = cfg.drafter
    temperature = float(dcfg.temperature)
    loss_fn = LOSSES[getattr(dcfg.loss, "value", dcfg.loss)]
    logits = student(batch["input_ids"], batch["attention_mask"], batch["select"])
    teacher = batch["target_logits"]
    loss = loss_fn(logits, teacher, temperature).sum() * temperature ** 2
    select = batch["select"]
    correct = torch.zeros_like(select)
    correct[select] = logits.detach().argmax(-1) == teacher.argmax(-1)
    num = int(select.sum())
    metrics = {"correct": [int(correct.sum())], "total": [num], "chain": []}
    chain = correct
    for j in range(dcfg.simulated_k):
        if j:
            chain = chain & torch.nn.functional.pad(correct[:, j:], (0, j))
        metrics["chain"].append(int(chain.sum()))
    return loss, num, metrics


def trained_weights(student: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the student (LoRA adapters included, unmerged), on CPU: what a
    checkpoint holds. A tied weight (lm_head = embedding) is stored once; loading the
    state dict restores the tie."""
    weights, seen = {}, set()
    for name, tensor in student.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        weights[name] = tensor.detach().cpu().contiguous()
    return weights


def save(student: DistillStudent, directory: Path, extra: dict | None = None) -> None:
    """A plain HF directory (LoRA merged) plus `drafter.json` saying what trained it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    merged(student).save_pretrained(directory)
    (directory / "drafter.json").write_text(json.dumps({"drafter": NAME,
                                                        "student": getattr(student, "source", None),
                                                        **(extra or {})}, indent=2))


def layout(config: dict) -> str | None:
    """`ours` (drafter.json of a train folder) or `hf` (any Hugging Face causal LM), or None."""
    if config.get("drafter") == NAME:
        return "ours"
    if any(a.endswith("ForCausalLM") for a in config.get("architectures") or []):
        return "hf"
    return None


def load(directory: Path, target) -> nn.Module:
    """The saved student as an HF causal LM on the target's device and dtype."""
    return load_student(str(directory), target).to(target.device).eval()


