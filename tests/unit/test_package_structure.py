"""The drafter contract holds: no import cycle, `decoding/` independent of `drafters/`, one
registry, the same files and names for every drafter, typed options per drafter."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specforge_lite.config.registry import DRAFTERS

PACKAGE = Path(__file__).resolve().parents[2] / "specforge_lite"
CONTRACT = ("NAME", "Options", "UNTRACKED_OPTIONS", "SERVING_NOTE", "VLLM_SERVING", "LLAMACPP_SERVING",
            "READS_LAST_HIDDEN", "build", "target_layers", "batch_preparer",
            "loss_and_metrics", "trained_weights", "describe", "save", "load", "decoder", "export", "dry_size")
FILES = {"__init__.py", "options.py", "model.py", "train.py", "decode.py", "export.py"}
OPTIONAL_FILES = {"interop.py"}  # readers of the peers' layouts, where export.py would outgrow 400 lines


def module_imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in the file: an import inside a
    function still ties the two modules together (importing a submodule imports its parent
    packages too; a package importing its own submodules is not counted)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: anchored at this module's package
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target:
                    pieces = target.split(".")
                    deps |= {".".join(pieces[:i]) for i in range(1, len(pieces) + 1)}
        graph[name] = {d for d in deps if d in modules and d != name and not name.startswith(d + ".")
                       and not d.startswith(name + ".")}
    return graph


def test_the_import_graph_sees_function_level_imports():
    """The graph counts lazy imports (the validate -> eval_methods edge is module level, the
    stages -> validate one lives inside a function)."""
    graph = module_imports()
    assert "specforge_lite.config.validate" in graph["specforge_lite.stages"]
    assert "specforge_lite.config.methods" in graph["specforge_lite.config.validate"]


def test_no_import_cycle():
    graph = module_imports()
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for dep in graph[node]:
            assert state.get(dep) != 1, " -> ".join([*path, dep])
            if dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


def test_arrows_point_down():
    """Only the CLI and the stages themselves import a stage; the runtime imports nothing of
    decoding, the drafters or the stages."""
    for name, deps in module_imports().items():
        if not name.startswith(("specforge_lite.stages", "specforge_lite.__main__")):
            assert not [d for d in deps if d.startswith("specforge_lite.stages")], name
        if name == "specforge_lite.contract":  # the interface decoding and the drafters both build on
            assert deps <= {"specforge_lite"}, deps
        if name.startswith("specforge_lite.runtime"):
            assert not [d for d in deps if d.startswith(("specforge_lite.decoding", "specforge_lite.drafters",
                                                         "specforge_lite.serving"))], name


def test_no_package_module_is_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines (split the second idea out): {long}"


def test_decoding_and_the_contract_import_nothing_from_drafters():
    for name, deps in module_imports().items():
        if name.startswith(("specforge_lite.decoding", "specforge_lite.contract")):
            assert not [d for d in deps if d.startswith("specforge_lite.drafters")], name


def test_only_the_registry_imports_a_drafter_package():
    drafter_packages = {f"specforge_lite.drafters.{name}" for name in DRAFTERS}
    for name, deps in module_imports().items():
        if name == "specforge_lite.config.registry" or name.startswith("specforge_lite.drafters."):
            continue
        assert not deps & drafter_packages, f"{name} imports {deps & drafter_packages}: ask the registry"


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_every_drafter_has_the_same_files_names_and_a_config(name):
    module = DRAFTERS[name]
    folder = PACKAGE / "drafters" / name
    files = {p.name for p in folder.glob("*.py")}
    assert FILES <= files <= FILES | OPTIONAL_FILES, files - FILES - OPTIONAL_FILES or FILES - files
    assert all(len(p.read_text().splitlines()) <= 400 for p in folder.glob("*.py"))
    missing = [attr for attr in CONTRACT if not hasattr(module, attr)]
    assert not missing, f"{name} lacks {missing}"
    assert module.NAME == name and module.Options().name == name
    assert (PACKAGE / "conf" / "drafter" / f"{name}.yaml").exists()


def test_an_option_of_another_drafter_is_rejected(compose_cfg):
    from hydra.errors import ConfigCompositionException

    assert compose_cfg(["+recipe=smoke_medusa"]).drafter.num_heads == 3
    with pytest.raises(ConfigCompositionException, match="drafter.ttt_steps"):
        compose_cfg(["+recipe=smoke_medusa", "drafter.ttt_steps=3"])


def test_the_fingerprint_ignores_options_that_do_not_decide_the_weights(compose_cfg, tmp_path):
    from specforge_lite.stages.train import fingerprint

    def stamp(*overrides):
        return fingerprint(compose_cfg(["+recipe=smoke_distilled", f"run_dir={tmp_path}", *overrides]))

    assert stamp() == stamp("drafter.simulated_k=2") == stamp("train.log_every=7")
    assert stamp() != stamp("drafter.lora_rank=8") != stamp("train.lr=1e-2")


def test_the_method_catalogue_names_what_the_engine_builds():
    from specforge_lite.decoding.drafters import BUILTIN
    from specforge_lite.config.methods import ENGINE_DRAFTERS, VLLM_OF, known

    assert set(ENGINE_DRAFTERS) == set(BUILTIN)
    assert len(known()) == len(set(known())) and set(VLLM_OF.values()) <= set(known())
