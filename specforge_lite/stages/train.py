"""The `train` stage (not built yet)."""

from omegaconf import DictConfig

from specforge_lite.stages import StageNotBuilt


def run(cfg: DictConfig) -> None:
    raise StageNotBuilt("the 'train' stage is not built yet in this version of specforge_lite")
