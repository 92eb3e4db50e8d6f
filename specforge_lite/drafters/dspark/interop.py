"""DSpark drafters in the layouts users have, read into our `DSparkDrafter`: `ours` (a train folder),
`speculators` (`speculators_model_type: "dspark"`, our export or speculators' trainer: DFlash's
reading, `dflash/interop.py`, with the heads' fields and weights: `DSPARK`, the format the export
writes too) and `specforge` (SpecForge's `DSparkDraftModel` export, `dflash_config.projector_type:
"dspark"`, or the same made ready to serve as `Qwen3DSparkModel`: DFlash's SpecForge reading with the
heads; SpecForge trains no drafting from the anchor position)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import read_json_object
from specforge_lite.drafters.dflash.interop import load_specforge, load_speculators
from specforge_lite.drafters.dflash.model import Format
from specforge_lite.drafters.dspark.model import DSparkConfig, DSparkDrafter
from specforge_lite.drafters.dspark.train import load

ARCHITECTURE = "DSparkDraftModel"  # what speculators saves; vLLM reads the layers as its Qwen3DSparkModel
HEAD_TYPES = ("vanilla", "gated", "rnn")
# SpecForge's export, and its serving script's name for the same folder
SPECFORGE_ARCHITECTURES = ("DSparkDraftModel", "Qwen3DSparkModel")


def fields(cfg: DSparkConfig) -> dict[str, Any]:
    return {"markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
            "enable_confidence_head": cfg.confidence_head, "confidence_head_with_markov": cfg.confidence_with_markov}


def head_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The heads' weights a dspark folder holds, with their shapes."""
    h, v = config["transformer_layer_config"]["hidden_size"], config["transformer_layer_config"]["vocab_size"]
    r, kind = config["markov_rank"], config["markov_head_type"]
    shapes = {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (config["draft_vocab_size"], r)}
    if kind == "gated":
        shapes.update({"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)})
    elif kind == "rnn":
        shapes.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + h), "markov_head.joint_proj.bias": (3 * r,)})
    if config["enable_confidence_head"]:
        width = h + (r if config["confidence_head_with_markov"] else 0)
        shapes.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return shapes


def read_fields(config: dict[str, Any], where) -> dict[str, Any]:
    """Our config's head fields from a dspark config.json, each checked by name (speculators' defaults
    where absent)."""
    rank = config.get("markov_rank", 256)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise SpecforgeError(f"{where}: 'markov_rank' should be an integer >= 1 (0, no Markov head, is DFlash: "
                             f"read it as drafter=dflash), got {rank!r}")
    kind = config.get("markov_head_type", "vanilla")
    if kind not in HEAD_TYPES:
        raise SpecforgeError(f"{where}: 'markov_head_type' should be one of {', '.join(HEAD_TYPES)}, got {kind!r}")
    flags = {}
    for key in ("enable_confidence_head", "confidence_head_with_markov"):
        flags[key] = config.get(key, True)
        if not isinstance(flags[key], bool):
            raise SpecforgeError(f"{where}: {key!r} should be true or false, got {flags[key]!r}")
    return {"markov_rank": rank, "markov_head_type": kind, "confidence_head": flags["enable_confidence_head"],
            "confidence_with_markov": flags["confidence_head_with_markov"]}


def heads(config: dict[str, Any]) -> str:
    confidence = ("a confidence head" + (" reading the Markov embedding too" if config["confidence_head_with_markov"]
                                         else "") if config["enable_confidence_head"] else "no confidence head")
    return f"; a {config['markov_head_type']} Markov head of rank {config['markov_rank']} and {confidence}"


SERVING = ("vLLM 0.32 runs DSpark on its GPU model runner only (its CPU runner has no DSpark proposer), and\n"
           "its DSpark model has the vanilla Markov head only: a gated or rnn head is for speculators'\n"
           "tools, not vLLM. A non-causal drafter needs an attention backend with non-causal support.")

DSPARK = Format(model_type="dspark", architecture=ARCHITECTURE, config_class=DSparkConfig, drafter_class=DSparkDrafter,
                label="DSpark", fields=fields, shapes=head_shapes, read=read_fields, heads=heads, serving=SERVING)


def layout(config: dict) -> str | None:
    if config.get("drafter") == "dspark":
        return "ours"
    if config.get("speculators_model_type") == "dspark":
        return "speculators"
    method = config.get("dflash_config")
    if isinstance(method, dict) and method.get("projector_type") == "dspark" \
            and set(config.get("architectures") or []) & set(SPECFORGE_ARCHITECTURES):
        return "specforge"
    return None


def load_any(directory: Path, target) -> DSparkDrafter:
    directory = Path(directory)
    found = layout(read_json_object(directory / "config.json"))
    if found == "ours":
        return load(directory, target)
    if found == "speculators":
        return load_speculators(directory, target, fmt=DSPARK)
    if found == "specforge":
        return load_specforge(directory, target, fmt=DSPARK)
    raise SpecforgeError(f"{directory.name}/config.json describes no DSpark layout we read (our train folder, "
                         "speculators dspark, SpecForge DSparkDraftModel)")
