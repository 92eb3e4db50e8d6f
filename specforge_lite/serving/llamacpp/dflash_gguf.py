"""Our speculators DFlash export -> a GGUF of llama.cpp's `dflash` architecture (`draft-dflash`).

The layout `src/models/dflash.cpp` reads (upstream's converter writes the same names):
`fc` (A*H -> H) and `enc.output_norm` (our `hidden_norm`) fuse the target's hidden states;
each `blk.{i}` is a Qwen3 layer (`attn_norm`, `attn_{q,k,v,output}`, per-head `attn_q_norm` /
`attn_k_norm`, `ffn_norm`, `ffn_{gate,up,down}`) whose `attn_k` / `attn_v` also turn the fused
states into the keys and values llama.cpp injects into the drafter's cache; `output_norm`;
`output` over the draft vocabulary with `d2t` as absolute I64 target ids. The token embeddings
are the target's (llama.cpp shares them), so none are written. llama.cpp's DFlash rope is NeoX
(rotate-half, as in Hugging Face), so q / k rows are written as trained, unpermuted.

Metadata: `dflash.target_layers` are the target layers whose INPUT llama.cpp taps
(`llama_set_embeddings_layer_inp`), which is what our `aux_hidden_state_layer_ids` count (HF
`hidden_states[k]`), so they are written as they are; `dflash.block_size`;
`dflash.attention.causal` (llama.cpp sets the drafter context causal or not from it);
`tokenizer.ggml.mask_token_id` (the block's mask positions; the vocabulary is the target's).
llama.cpp drafts [last token, mask x n_max] at the next positions and reads rows 1..n_max,
as our decoder does (`sample_from_anchor` false).

Like `gguf_export`, this reads only the exported files (config.json + safetensors).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specforge_lite.checked_io import read_json_object
from specforge_lite.serving.llamacpp.gguf_export import (
    ATTN,
    MLP,
    add_weight,
    finish,
    new_writer,
    read_weights,
    to_numpy,
    write_llama_hparams,
)
from specforge_lite.serving.llamacpp.gguf_read import (TOKENIZER_PREFIX, GGUFExportError, gguf_module, gguf_summary,
                                                       read_gguf)

ARCH = "dflash"
MASK_KEY = "tokenizer.ggml.mask_token_id"


def read_dflash_export(directory: Path) -> tuple[dict, dict]:
    """(config, weights) of a speculators DFlash directory, the keys this writer reads checked."""
    directory = Path(directory)
    where = f"{directory.name}/config.json"
    if not (directory / "config.json").is_file():
        raise GGUFExportError(f"{directory}/config.json: missing (not a speculators DFlash export)")
    config = read_json_object(directory / "config.json")
    layer = config.get("transformer_layer_config")
    if config.get("speculators_model_type") != "dflash" or not isinstance(layer, dict):
        raise GGUFExportError(f"{where}: not a speculators DFlash config (speculators_model_type dflash with a "
                              "transformer_layer_config)")
    if layer.get("model_type") != "qwen3":
        raise GGUFExportError(f"{where}: llama.cpp's dflash graph runs Qwen3-style layers, not "
                              f"{layer.get('model_type')!r}")
    if config.get("sample_from_anchor"):
        raise GGUFExportError(f"{where}: sample_from_anchor=true; llama.cpp's draft-dflash reads block rows 1.. only")
    if config.get("target_hidden_size") not in (None, layer["hidden_size"]):
        raise GGUFExportError(f"{where}: target_hidden_size differs from the draft layers'; not written")
    weights = read_weights(directory)
    wanted = ["fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight"]
    for i in range(int(layer["num_hidden_layers"])):
        p = f"layers.{i}."
        wanted += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                   p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight",
                   *(f"{p}self_attn.{n}.weight" for n in ATTN), *(f"{p}mlp.{n}.weight" for n in MLP)]
    missing = [name for name in wanted if name not in weights]
    if missing:
        raise GGUFExportError(f"{directory.name}: weights missing: {', '.join(missing)}")
    return config, weights


def absolute_d2t(offsets, vocab_size: int, where: str) -> np.ndarray:
    """Our d2t (target id - draft id) -> llama.cpp's (the target id), checked to be a valid map."""
    d2t = np.asarray(to_numpy(offsets), dtype=np.int64).reshape(-1)
    d2t = d2t + np.arange(d2t.size, dtype=np.int64)
    if d2t.min() < 0 or d2t.max() >= vocab_size or np.unique(d2t).size != d2t.size:
        raise GGUFExportError(f"{where}: d2t maps outside the target vocabulary or twice to one id")
    return d2t


def copy_target_tokenizer(target_gguf: Path, writer, mask_token_id: int) -> None:
    """The target's vocabulary (llama.cpp reads the mask id from the draft's own vocabulary)."""
    reader = read_gguf(target_gguf)
    gguf = gguf_module()
    for name, field in reader.fields.items():
        if name.startswith(TOKENIZER_PREFIX) and name != MASK_KEY:
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_mask_token_id(int(mask_token_id))


def dflash_to_gguf(export_dir: Path, target_gguf: Path, out: Path, precision: str = "f16") -> Path:
    """Our speculators DFlash export -> a `dflash` GGUF that runs beside `target_gguf`."""
    export_dir = Path(export_dir)
    where = f"{export_dir.name}/config.json"
    config, weights = read_dflash_export(export_dir)
    layer = config["transformer_layer_config"]
    target = gguf_summary(target_gguf)
    if layer["vocab_size"] != target["vocab_size"] or layer["hidden_size"] != target["embedding_length"]:
        raise GGUFExportError(f"{where}: drafter (vocab {layer['vocab_size']}, hidden {layer['hidden_size']}) does "
                              f"not fit target {Path(target_gguf).name} (vocab {target['vocab_size']}, hidden "
                              f"{target['embedding_length']})")
    aux = [int(i) for i in config["aux_hidden_state_layer_ids"]]
    if not aux or min(aux) < 0 or max(aux) >= int(target["block_count"]):
        raise GGUFExportError(f"{where}: aux layers {aux} are not inputs of this {target['block_count']}-layer "
                              "target's decoder layers")
    mask = int(config["mask_token_id"])
    if not 0 <= mask < target["vocab_size"]:
        raise GGUFExportError(f"{where}: mask_token_id {mask} is not a target token id")
    n_layers = int(layer["num_hidden_layers"])
    writer = new_writer(out, ARCH)
    write_llama_hparams(writer, layer, n_layers, target["vocab_size"], precision, where)
    writer.add_array(f"{ARCH}.target_layers", aux)
    writer.add_uint32(f"{ARCH}.target_hidden_size", int(target["embedding_length"]))
    writer.add_uint32(f"{ARCH}.block_size", int(config["block_size"]))
    writer.add_bool(f"{ARCH}.attention.causal", not config["sliding_window_non_causal"])
    writer.add_bool(f"{ARCH}.sample_from_anchor", False)
    copy_target_tokenizer(target_gguf, writer, mask)
    add_weight(writer, "fc.weight", to_numpy(weights["fc.weight"]), precision)
    add_weight(writer, "enc.output_norm.weight", to_numpy(weights["hidden_norm.weight"]), precision)
    for i in range(n_layers):
        add_qwen3_block(writer, i, weights, precision)
    add_weight(writer, "output_norm.weight", to_numpy(weights["norm.weight"]), precision)
    add_weight(writer, "output.weight", to_numpy(weights["lm_head.weight"]), precision)
    if "d2t" in weights:
        d2t = absolute_d2t(weights["d2t"], target["vocab_size"], export_dir.name)
        writer.add_tensor("d2t", d2t, raw_dtype=gguf_module().GGMLQuantizationType.I64)
    return finish(writer, Path(out))


def add_qwen3_block(writer, block: int, weights: dict, precision: str) -> None:
    """Drafter layer `layers.{block}.*` as `blk.{block}.*` (NeoX rope: q / k rows as trained)."""
    src, out = f"layers.{block}", f"blk.{block}"
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for hf, ours in norms.items():
        add_weight(writer, f"{out}.{ours}.weight", to_numpy(weights[f"{src}.{hf}.weight"]), precision)
    for hf, ours in ATTN.items():
        add_weight(writer, f"{out}.{ours}.weight", to_numpy(weights[f"{src}.self_attn.{hf}.weight"]), precision)
    for hf, ours in MLP.items():
        add_weight(writer, f"{out}.{ours}.weight", to_numpy(weights[f"{src}.mlp.{hf}.weight"]), precision)
