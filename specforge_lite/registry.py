"""The one list of trainable drafters: name -> its package (the `contract.DrafterModule` names).

Adding a drafter is a folder under `drafters/`, a `conf/drafter/NAME.yaml` and one line here
(docs/ADDING_A_DRAFTER.md).
"""

from __future__ import annotations

from specforge_lite import SpecforgeError
from specforge_lite.drafters import distilled, eagle3, medusa, peagle

DRAFTERS = {
    "eagle3": eagle3,
    "medusa": medusa,
    "distilled": distilled,
    "peagle": peagle,
}

# names of earlier versions, and what they are called now
RENAMED = {"draft_model": "distilled"}


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
