"""Whether transformers can build a target folder's model_type, before any weight is read: the
door's check for families we cannot run, and for code in the folder the user has not allowed."""

from __future__ import annotations

from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import read_json_object


def check_model_type(path: Path, target_cfg) -> None:
    """A local target whose model_type transformers does not know: only the folder's own code
    (config.json's `auto_map`) defines it, and that code runs only where the user allows it
    (`target.trust_remote_code`); without such code nothing can build it. A known model_type
    runs transformers' own class, whatever `auto_map` says."""
    from transformers import CONFIG_MAPPING, __version__

    config = read_json_object(path / "config.json")
    kind = config["model_type"]
    if kind in CONFIG_MAPPING or (config.get("auto_map") and target_cfg.trust_remote_code):
        return
    if config.get("auto_map"):
        raise SpecforgeError(f"target.path={target_cfg.path!r}: model_type {kind!r} is defined by code in the folder "
                             f"(config.json auto_map), not by transformers {__version__}; read that code, then set "
                             "target.trust_remote_code=true to run it")
    raise SpecforgeError(f"target.path={target_cfg.path!r}: transformers {__version__} does not know model_type "
                         f"{kind!r} and the folder has no code for it (no auto_map in config.json); a newer "
                         "transformers may know it")


def config_from_dict(values: dict):
    """A family's own HF config class (Llama, Qwen3, Qwen3-MoE, ...) built from a config.json's values."""
    from transformers import AutoConfig

    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)
