"""The one list of trainable drafters: name -> its package (the `contract.DrafterModule` names).

Adding a drafter is a folder under `drafters/`, a `conf/drafter/NAME.yaml` and one line here
(docs/ADDING_A_DRAFTER.md).
"""

from __future__ import annotations

from specforge_lite import SpecforgeError
from specforge_lite.config.schema import Config, name_drafters
from specforge_lite.drafters import dflash, distilled, dspark, eagle3, medusa, peagle

DRAFTERS = {
    "eagle3": eagle3,
    "medusa": medusa,
    "distilled": distilled,
    "peagle": peagle,
    "dflash": dflash,
    "dspark": dspark,
}

# names of earlier versions, and what they are called now
RENAMED = {"draft_model": "distilled"}

# why `export.sglang=true` cannot be honoured for a drafter; a drafter not named here has an
# SGLang layout (its export writes `export/sglang`)
NO_SGLANG_LAYOUT = {
    "peagle": "SGLang has no P-EAGLE drafter (parallel drafting with a mask token); export it for vLLM only "
              "(export.sglang=false)",
    "dflash": "this project writes no SGLang DFlash layout; export it for vLLM only (export.sglang=false)",
    "dspark": "this project writes no SGLang DSpark layout; export it for vLLM only (export.sglang=false)",
    "medusa": "SGLang serves no Medusa heads; export them for vLLM only (export.sglang=false)",
    "distilled": "a draft model is a plain Hugging Face folder (export/draft_model) that SGLang loads as it is; "
                 "set export.sglang=false",
}


def engine_module(kind: str, folder, target):
    """Drafter `kind`'s module from the trained folder `folder`, in the dtype the target decodes in:
    a drafter saved as trained (float32) drafts from the target's hidden states at the target's
    arithmetic (docs/ENGINES.md, "Checks that keep a report honest")."""
    return DRAFTERS[kind].load(folder, target).to(target.dtype)


def engine_decoder(kind: str, folder, target):
    """`engine_module` as the decoding engine's drafter (what evaluate decodes with)."""
    return DRAFTERS[kind].decoder(engine_module(kind, folder, target))


def hidden_layers_of(kind: str, module) -> tuple[int, ...]:
    """The target hidden states drafter `kind`'s `module` reads while decoding (its engine drafter's
    `hidden_state_layers`), known before the run's dtype is chosen."""
    return tuple(DRAFTERS[kind].decoder(module).hidden_state_layers)


def sglang_refusal(name: str) -> str | None:
    """Why SGLang's layout cannot hold drafter `name` (export.sglang=true), or None when it can."""
    return NO_SGLANG_LAYOUT.get(RENAMED.get(name, name))


def drafter_module(name: str):
    """The drafter package registered as `name` (an earlier name is read as its new one)."""
    name = RENAMED.get(name, name)
    if name not in DRAFTERS:
        raise SpecforgeError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    return DRAFTERS[name]


def chosen_drafter(cfg):
    """The package of the drafter a composed config chose (`drafter=NAME`)."""
    from omegaconf import OmegaConf

    module = drafter_module(cfg.drafter.name)
    if OmegaConf.get_type(cfg.drafter) is not module.Options:
        raise SpecforgeError(f"drafter.name={cfg.drafter.name} does not choose the drafter: the drafter group does "
                             f"(drafter={module.NAME}), and its options come with it")
    return module


def detect_drafter(directory) -> tuple[str, str]:
    """(drafter name, layout) of a drafter folder in any layout a registered drafter reads:
    our train folders, and the formats of speculators / vLLM, SGLang / SpecForge and Hugging
    Face. Raises SpecforgeError naming the folder when none does."""
    from pathlib import Path

    from specforge_lite.checked_io import read_json_object

    directory = Path(directory)
    if not directory.is_dir():
        raise SpecforgeError(f"drafter folder {directory} does not exist")
    configs = []
    for name in ("drafter.json", "config.json"):  # a distilled student keeps an HF config.json beside drafter.json
        if (directory / name).exists():
            configs.append(read_json_object(directory / name))
    if not configs:
        raise SpecforgeError(f"{directory} holds no drafter (no config.json)")
    for config in configs:
        if config.get("drafter") in RENAMED:  # folders written by earlier versions
            config = {**config, "drafter": RENAMED[config["drafter"]]}
        for module in DRAFTERS.values():
            if found := module.layout(config):
                return module.NAME, found
    raise SpecforgeError(f"{directory.name}/config.json is no drafter layout we read: our train folders, "
                         "speculators (speculators_model_type), SGLang (LlamaForCausalLMEagle3), vLLM Medusa "
                         "(model_type medusa) or a Hugging Face causal LM")


def register_configs() -> None:
    """`base_config` (the root schema) and, per registered drafter, `drafter/NAME_schema`,
    which `conf/drafter/NAME.yaml` lists first in its defaults."""
    from hydra.core.config_store import ConfigStore

    name_drafters(DRAFTERS)  # eval.drafter_dirs: a field per drafter
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for name, module in DRAFTERS.items():
        cs.store(group="drafter", name=f"{name}_schema", node=module.Options)


def say_what_the_trained_folder_decides(folder, layout: str, cfg) -> None:
    """Warn where a trained drafter (our layout) is not what the command line asked of it: the
    target weights it records were changed since training, or a `drafter.*` setting given on
    the command line differs from the value the folder was trained with (which is the one used;
    the training settings are read from the folder, not from the config)."""
    import json
    import logging

    from specforge_lite.drafters.common import drafter_info
    from specforge_lite.targets.digest import recorded_files, same_weights

    if layout != "ours":
        return
    info, log = drafter_info(folder), logging.getLogger(__name__)
    made = info.get("target_files") or {}
    if made.get("weights"):
        if not same_weights(made, recorded_files(cfg.target.path)):
            log.warning("%s was trained for other weights than the target's at %s now (they changed after "
                        "training): it is measured as it is; train again (python -m specforge_lite train ...) "
                        "for these weights", folder, cfg.target.path)
    for key, value in command_line_settings("drafter."):
        if key in info and info[key] != value:
            log.warning("drafter.%s=%s is a training setting: the drafter in %s was trained with %s=%s, which is "
                        "used", key, json.dumps(value), folder, key, json.dumps(info[key]))


def given_on_command_line(key: str) -> bool | None:
    """Whether `key` was set on this Hydra run's command line (False: its value is the recipe's or
    the default); None outside a Hydra run (a config composed in code), where nothing is known."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = HydraConfig.get().overrides.task
    except (ImportError, ValueError):
        return None
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def command_line_settings(prefix: str) -> list[tuple[str, object]]:
    """`(key, value)` of the command line's `prefix*` overrides (values as YAML reads them);
    none outside a Hydra run (a test composing its config)."""
    import yaml

    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = HydraConfig.get().overrides.task
    except (ImportError, ValueError):
        return []
    pairs = [o.lstrip("+~").split("=", 1) for o in overrides if o.lstrip("+~").startswith(prefix) and "=" in o]
    return [(key[len(prefix):], yaml.safe_load(value)) for key, value in pairs]
