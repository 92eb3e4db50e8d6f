"""docs/ADDING_A_DRAFTER.md holds: a drafter is one folder, one YAML and one registry line.

A throwaway drafter, a copy of Medusa's folder under another name, is added the way the guide
says (its folder, its `conf/drafter/NAME.yaml`, one entry in `drafters.registry.DRAFTERS`) and
then chosen like any other; and no module outside `drafters/` and the registry branches on
a drafter's name, so nothing else would need an edit.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from transformers import LlamaConfig

from specforge_lite import SpecforgeError
from specforge_lite.drafters import methods, registry
from specforge_lite.drafters.registry import register_configs
from specforge_lite.stages.door import config_problems
from specforge_lite.contract import DrafterModule

PACKAGE = Path(__file__).resolve().parents[2] / "specforge_lite"
CONF_DIR = PACKAGE / "conf"
NEW = "scratch_heads"
EXISTING = tuple(registry.DRAFTERS)  # the drafters registered before the test adds one

# Modules that name a drafter for a reason other than choosing behaviour by drafter name:
# module (relative to the package) -> why. Keep this short; each entry is a claim to check.
NOT_A_BRANCH = {
    "serving/llamacpp/gguf_export.py": "converts a speculators EAGLE-3 folder to llama.cpp's GGUF: its 'eagle3' "
                                       "is speculators' `speculators_model_type` and llama.cpp's architecture "
                                       "name, the formats it reads and writes",
    "serving/llamacpp/dflash_gguf.py": "converts a speculators DFlash folder to llama.cpp's GGUF: its 'dflash' "
                                       "is speculators' `speculators_model_type`, the format it reads",
}


def copy_medusa(root: Path) -> None:
    """drafters/medusa/*.py as package NEW under `root`: its imports of itself and the names it
    registers and writes renamed, vLLM's own "medusa" (model_type, method) left alone."""
    src, dst = PACKAGE / "drafters" / "medusa", root / NEW
    dst.mkdir()
    renames = {  # file -> (old, new) pairs that must each be found
        "__init__.py": [('NAME = "medusa"', f'NAME = "{NEW}"')],
        "options.py": [('name: str = "medusa"', f'name: str = "{NEW}"')],
        "decode.py": [('name = "medusa"', f'name = "{NEW}"')],
        "model.py": [('save_drafter(directory, "medusa"', f'save_drafter(directory, "{NEW}"')],
        "export.py": [('config.get("drafter") == "medusa"', f'config.get("drafter") == "{NEW}"')],
    }
    for path in src.glob("*.py"):
        text = path.read_text().replace("specforge_lite.drafters.medusa", NEW)
        for old, new in renames.get(path.name, []):
            assert old in text, f"drafters/medusa/{path.name} no longer has {old!r}: update this test's copy"
            text = text.replace(old, new)
        (dst / path.name).write_text(text)


def compose_with(conf_dir: Path, overrides: list[str]):
    """The real config, with `conf_dir` (holding drafter/NEW.yaml) on Hydra's search path."""
    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(config_name="config", overrides=[f"hydra.searchpath=[file://{conf_dir}]", *overrides])


@pytest.fixture
def new_drafter(tmp_path, monkeypatch):
    """NEW's folder and YAML in a temporary place, and its one registry entry."""
    copy_medusa(tmp_path)
    conf = tmp_path / "conf"
    (conf / "drafter").mkdir(parents=True)
    yaml = (CONF_DIR / "drafter" / "medusa.yaml").read_text().replace("medusa_schema", f"{NEW}_schema")
    (conf / "drafter" / f"{NEW}.yaml").write_text(yaml)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = importlib.import_module(NEW)
        yield module, conf
    finally:
        for name in [m for m in sys.modules if m == NEW or m.startswith(NEW + ".")]:
            del sys.modules[name]
        ConfigStore.instance().repo.get("drafter", {}).pop(f"{NEW}_schema.yaml", None)
        shutil.rmtree(tmp_path / NEW, ignore_errors=True)


def test_a_new_drafter_needs_its_folder_its_yaml_and_one_registry_line(new_drafter, monkeypatch):
    module, conf = new_drafter
    with pytest.raises((HydraException, OmegaConfBaseException, SpecforgeError)):
        compose_with(conf, [f"drafter={NEW}"])  # before its registry line: no schema, no drafter

    monkeypatch.setitem(registry.DRAFTERS, NEW, module)  # the one registry line
    cfg = compose_with(conf, [f"drafter={NEW}", f"eval.methods=[plain,{NEW},ngram]", f"eval.best_k_method={NEW}"])
    assert cfg.drafter.name == NEW
    assert registry.chosen_drafter(cfg) is module
    assert config_problems(cfg) == []
    # its options are typed by its own dataclass: another drafter's option is refused
    with pytest.raises((HydraException, OmegaConfBaseException)):
        compose_with(conf, [f"drafter={NEW}", "drafter.ttt_steps=3"])
    # the method catalogue lists it, and vLLM serves it as Medusa's contract entry says
    assert NEW in methods.known()
    assert methods.served_drafters()[NEW] == module.VLLM_SERVING
    # the folder it saves is recognised as its own
    assert module.layout({"drafter": NEW})
    assert registry.drafter_module(NEW) is module
    # it has every name of the contract, and the dry run sizes it from a target's config alone
    assert [name for name in DrafterModule.__annotations__ if not hasattr(module, name)] == []
    target_config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=1000)
    size = module.dry_size(cfg, target_config, 2, 32)
    assert size.trainable_params > 0 and size.activation_bytes > 0


def drafter_name_uses(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) where a drafter's name, or a method named after one (vllm_NAME,
    llamacpp_NAME), is compared with something, keys or fills a dict, is listed in a
    tuple / list / set, or is a match case: the ways code chooses behaviour by name."""
    spelled = {f"{prefix}{name}": name for name in names for prefix in ("", "vllm_", "llamacpp_")}

    def constants(node: ast.AST) -> list[ast.Constant]:
        return [n for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in spelled]

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hits = constants(node)
        elif isinstance(node, ast.Dict):
            hits = [c for part in [*node.keys, *node.values] if isinstance(part, ast.Constant)
                    for c in constants(part)]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            hits = [c for e in node.elts if isinstance(e, ast.Constant) for c in constants(e)]
        elif isinstance(node, ast.match_case):
            hits = constants(node.pattern)
        else:
            continue
        found += [(c.lineno, c.value) for c in hits]
    return sorted(set(found))


def test_the_scan_sees_each_way_of_branching_on_a_name():
    code = """
if cfg.drafter.name == "medusa": pass
if kind in ("eagle3", "peagle"): pass
GGUF = {"distilled": "draft-simple"}
LLAMACPP = ("llamacpp_plain", "llamacpp_eagle3")
match name:
    case "peagle": pass
log.info("trained eagle3")            # a mention, not a branch
writer(out, "eagle3")                 # an argument, not a branch
"""
    assert [name for _, name in drafter_name_uses(ast.parse(code), set(EXISTING))] == [
        "medusa", "eagle3", "peagle", "distilled", "llamacpp_eagle3", "peagle"]


def test_nothing_outside_drafters_and_the_registry_branches_on_drafter_names():
    branching = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("drafters/") or rel == "drafters/registry.py" or rel in NOT_A_BRANCH:
            continue
        if rel.startswith("records/"):  # the docs and gpu-check name the methods of the results they record
            continue
        uses = drafter_name_uses(ast.parse(path.read_text()), set(EXISTING))
        if uses:
            branching[rel] = [f"line {line}: {name!r}" for line, name in uses]
    assert branching == {}, ("these modules choose behaviour by drafter name; a new drafter would need an edit "
                             "there (declare it in the drafter's contract instead): "
                             + "; ".join(f"{rel} ({', '.join(uses)})" for rel, uses in branching.items()))
