"""The distilled draft model's module: a small causal LM that shares the target's
tokenizer (`drafter=distilled`), with optional LoRA adapters.

Shapes: B batch, T sequence, V vocab (the target's, which the student must share),
N loss positions in a micro-batch.

Student: `drafter.student` (an HF dir or hub id) or, when null, a copy of the target's
first `drafter.student_layers` layers with its embedding, final norm and lm_head
(weights copied, not shared). Loss at every assistant token x[i] (position i-1
predicts it): one of `losses.LOSSES` between the target's and the student's
distributions at temperature T, scaled by T^2 so gradients keep their size across
temperatures. Full fine-tuning, or LoRA adapters through `peft` that are merged into
the weights when the student is saved. The saved student is a plain HF directory
vLLM serves as `{"method": "draft_model"}`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from specforge_lite import SpecforgeError


class DistillStudent(nn.Module):
    """Wraps the student LM so one call (through DDP) gives logits at the loss positions only.

    The lm_head over the full vocabulary is most of a small student's cost; running it at
    the N selected positions instead of all B*T saves most of it.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def base(self) -> nn.Module:
        """The HF causal LM under any peft wrapper."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask: [B, T]; select: [B, T] bool -> logits [N, V] at the selected positions."""
        base = self.base()
        hidden = base.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return base.get_output_embeddings()(hidden[select])


def truncated_student(target, num_layers: int) -> nn.Module:
    """An independent copy of the target's first `num_layers` layers, embedding, final norm and lm_head."""
    from transformers import AutoModelForCausalLM

    total = target.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise SpecforgeError(f"drafter.student_layers={num_layers}: the target has {total} layers")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    student = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    # a target sharded over ranks (trainer.shard_target) holds DTensors: gather the kept ones
    # (collective: every rank builds the student)
    kept = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in target.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    missing, unexpected = student.load_state_dict(kept, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise SpecforgeError(f"truncated copy of {type(target).__name__}: missing {missing}, unexpected {unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        student.tie_weights()
    student.generation_config = copy.deepcopy(target.generation_config)
    return student


def load_student(path: str, target, tokenizer=None) -> nn.Module:
    """An HF causal LM from a dir or hub id; refuses a vocabulary other than the target's."""
    from transformers import AutoTokenizer

    from specforge_lite.targets.loading import load_causal_lm, resolve_target_path

    resolved = resolve_target_path(path, "drafter.student")
    student = load_causal_lm(resolved, target.dtype, f"draft model {path}", strict=True)
    ours = student.get_output_embeddings().weight.shape[0]
    theirs = target.get_output_embeddings().weight.shape[0]
    if ours != theirs:
        raise SpecforgeError(f"drafter.student={path} has a vocabulary of {ours} tokens, the target {theirs}: "
                             "a draft model must share the target's tokenizer and vocabulary")
    if tokenizer is not None and Path(resolved, "tokenizer_config.json").exists():
        student_vocab = AutoTokenizer.from_pretrained(resolved).get_vocab()
        if student_vocab != tokenizer.get_vocab():
            differ = sorted(set(student_vocab.items()) ^ set(tokenizer.get_vocab().items()))[:3]
            raise SpecforgeError(f"drafter.student={path}: its tokenizer maps tokens differently from the "
                                 f"target's (e.g. {differ}); a draft model must share the target's vocabulary")
    return student


def add_lora(student: nn.Module, dcfg) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise SpecforgeError("drafter.lora=true needs peft: pip install peft") from err
    config = LoraConfig(r=dcfg.lora_rank, lora_alpha=dcfg.lora_alpha, lora_dropout=dcfg.lora_dropout,
                        target_modules=list(dcfg.lora_target_modules), bias="none")
    return get_peft_model(student, config)


def merged(student: DistillStudent) -> nn.Module:
    """A plain HF model with any LoRA adapters folded into the weights (the original is untouched)."""
    lm = copy.deepcopy(student.lm)
    return lm.merge_and_unload() if hasattr(lm, "merge_and_unload") else lm
