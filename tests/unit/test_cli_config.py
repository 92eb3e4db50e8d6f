"""The CLI and the typed config schema, through the real Hydra configs."""

from __future__ import annotations

import pytest

from tests.conftest import CONF_DIR


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml")))
def test_every_recipe_composes(compose_cfg, recipe):
    cfg = compose_cfg([f"+recipe={recipe}"])
    assert cfg.recipe_name == recipe
    assert cfg.run_dir == f"runs/{recipe}"


def test_no_config_sets_hydra_mode_so_the_cli_composes_once(monkeypatch):
    """`__main__.compose_once` skips Hydra's compose that only reads hydra.mode: right while no
    recipe sets it (None then, as that compose would find); an override of it keeps Hydra's own way."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.hydra import Hydra

    from specforge_lite.__main__ import compose_once
    from specforge_lite.drafters.registry import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        for recipe in sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml")):
            cfg = compose(config_name="config", overrides=[f"+recipe={recipe}"], return_hydra_config=True)
            assert cfg.hydra.mode is None, recipe
    monkeypatch.setattr(Hydra, "get_mode", Hydra.get_mode)  # restored after the test
    hydras_own = Hydra.get_mode
    compose_once(["+recipe=smoke", "hydra.mode=MULTIRUN"])
    assert Hydra.get_mode is hydras_own
    compose_once(["+recipe=smoke"])
    assert Hydra.get_mode is not hydras_own and Hydra.get_mode(None, "config", []) is None


def test_smoke_recipe_overrides_groups(compose_cfg):
    cfg = compose_cfg(["+recipe=smoke"])
    assert cfg.target.path == "builtin:tiny-llama"
    assert cfg.data.source == "builtin:smoke"
    assert cfg.eval.dataset == "heldout"


def test_unknown_key_is_rejected(compose_cfg):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="sample.no_such_key"):
        compose_cfg(["+recipe=smoke", "sample.no_such_key=1"])


def test_wrong_type_is_rejected(compose_cfg):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="batch_size"):
        compose_cfg(["sample.batch_size=many"])
    with pytest.raises(ConfigCompositionException, match="turns"):
        compose_cfg(["sample.turns=some"])


def test_help_lists_stages(cli):
    proc = cli("--help")
    assert proc.returncode == 0
    for stage in ("sample", "train", "evaluate", "export", "run"):
        assert f"  {stage} " in proc.stdout
    assert "smoke" in proc.stdout and "eagle_smollm2" in proc.stdout


@pytest.mark.parametrize("command", ["docs", "gpu-check", "families"])
def test_every_command_takes_help(cli, command):
    """The usage says `COMMAND --help` lists a command's options: it does for each one, and runs
    nothing (families refused it: issue 65)."""
    proc = cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m specforge_lite {command}"), proc.stdout
    assert "error" not in proc.stderr


def test_unknown_stage_fails(cli):
    proc = cli("fly")
    assert proc.returncode == 2
    assert "unknown stage 'fly'" in proc.stderr


def test_cli_rejects_unknown_key_with_hydra_message(cli):
    proc = cli("sample", "+recipe=smoke", "sample.bogus=3")
    assert proc.returncode != 0
    assert "Key 'bogus' not in 'SampleConfig'" in proc.stderr


def test_cfg_job_prints_resolved_config(cli):
    proc = cli("sample", "+recipe=smoke", "--cfg", "job", "--resolve")
    assert proc.returncode == 0, proc.stderr
    assert "run_dir: runs/smoke" in proc.stdout
    assert "path: builtin:tiny-llama" in proc.stdout
    assert "stage: sample" in proc.stdout
