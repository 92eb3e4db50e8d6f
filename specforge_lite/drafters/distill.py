"""Draft-model distillation (`drafter.name=draft_model`): a small causal LM that shares
the target's tokenizer, trained to match the target's next-token distribution.

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
import json
import logging
from pathlib import Path

import torch
from torch import nn

from specforge_lite import SpecforgeError

log = logging.getLogger(__name__)


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

    from specforge_lite.targets import load_causal_lm, resolve_target_path

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


# ---------------------------------------------------------------------- training objective

def build(cfg, target, token_counts: torch.Tensor) -> DistillStudent:
    """token_counts is unused: a draft model keeps the target's whole vocabulary."""
    from specforge_lite.targets import load_tokenizer

    dcfg = cfg.drafter
    torch.manual_seed(cfg.train.seed)
    if dcfg.student:
        lm = load_student(dcfg.student, target, load_tokenizer(cfg.target))
    else:
        lm = truncated_student(target, dcfg.student_layers)
    lm = lm.to(target.device).train()
    if dcfg.lora:
        lm = add_lora(lm, dcfg)
    if not 0 < dcfg.temperature:
        raise SpecforgeError(f"drafter.temperature must be > 0, got {dcfg.temperature}")
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
    from specforge_lite.losses import LOSSES

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


# ---------------------------------------------------------------------- save / load / export

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
    (directory / "drafter.json").write_text(json.dumps({"drafter": "draft_model",
                                                        "student": getattr(student, "source", None),
                                                        **(extra or {})}, indent=2))


def load(directory: Path, target) -> nn.Module:
    """The saved student as an HF causal LM on the target's device and dtype."""
    return load_student(str(directory), target).to(target.device).eval()


@torch.no_grad()
def max_logit_difference(a: nn.Module, b: nn.Module, vocab_size: int) -> float:
    torch.manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, 16), device=a.device)
    return float((a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max())


def export(cfg, trained: Path, out: Path, target, tokenizer, k: int, k_source: str, verifier: str) -> dict:
    """Copy the student to `out/draft_model` with the target's tokenizer, reload it strictly
    (same keys and shapes, same logits) and write a README with the vLLM command."""
    from specforge_lite.artifact_io import load_safetensors
    from specforge_lite.artifacts import atomic_write_text

    trained_model = load(trained, target)
    directory = out / "draft_model"
    directory.mkdir(parents=True, exist_ok=True)
    trained_model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    reloaded = load_student(str(directory), target, tokenizer).to(target.device).eval()
    written = {}
    for f in sorted(directory.glob("*.safetensors")):
        written.update(load_safetensors(f))
    expected = {k: tuple(v.shape) for k, v in trained_model.state_dict().items()}
    bad = [k for k in written if k not in expected or tuple(written[k].shape) != expected[k]]
    untied_missing = [k for k in expected if k not in written and k != "lm_head.weight"]
    if bad or untied_missing:
        raise SpecforgeError(f"{directory}: unexpected or misshapen {bad}, missing {untied_missing}")
    diff = max_logit_difference(trained_model, reloaded, trained_model.config.vocab_size)
    if diff != 0.0:
        raise SpecforgeError(f"{directory}: reloaded draft model differs from the trained one (max |dlogit| {diff})")
    log.info("draft-model export passed its strict reload (keys, shapes, tokenizer vocab; logits identical)")
    layers = trained_model.config.num_hidden_layers
    atomic_write_text(directory / "README.md", f"""# Draft model for {verifier}

Distilled by specforge_lite (recipe `{cfg.recipe_name}`): a {layers}-layer causal LM with the
target's tokenizer, trained on the target's own answers with {getattr(cfg.drafter.loss, 'value', cfg.drafter.loss)}
at temperature {cfg.drafter.temperature}{' (LoRA, merged)' if cfg.drafter.lora else ''}. Speculative tokens k = {k} ({k_source}).

```bash
vllm serve {verifier} \\
  --speculative-config '{{"method": "draft_model", "model": "<this directory>", "num_speculative_tokens": {k}}}'
```

The draft and the target must share the vocabulary (vLLM checks the sizes). It is also a
plain Hugging Face model: `AutoModelForCausalLM.from_pretrained("<this directory>")`, usable
as `assistant_model` in `transformers` assisted generation.
""")
    return {"format": "draft_model (Hugging Face causal LM)", "path": str(directory), "speculative_tokens": k}
