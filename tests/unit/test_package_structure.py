"""The drafter contract holds: no import cycle, `decoding/` independent of `drafters/`, one
registry, the same files and names for every drafter, typed options per drafter."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specforge_lite.drafters.registry import DRAFTERS

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
    """The graph counts lazy imports (the door -> methods edge is module level, the door ->
    targets.loading one lives inside a function)."""
    graph = module_imports()
    assert "specforge_lite.targets.loading" in graph["specforge_lite.stages.door"]
    assert "specforge_lite.drafters.methods" in graph["specforge_lite.stages.door"]


def assert_no_cycle(graph: dict, what: str = "") -> None:
    """Depth-first over `graph` (node -> its successors); fails naming the first loop found."""
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for dep in graph.get(node, ()):
            assert state.get(dep) != 1, what + " -> ".join([*path, dep])
            if dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


def test_no_import_cycle():
    assert_no_cycle(module_imports())


GROUND = "ground"  # the root modules: errors, the contract, the stage table, run folders, checked reading
TOP = {"specforge_lite.__main__", "specforge_lite.records"}  # the CLI and what only it runs (docs, gpu-check)


def package_of(module: str) -> str:
    """The package a module belongs to: `specforge_lite.X...` -> X for a sub-package X, the
    ground for the root's own modules, and the top for the CLI and `records`."""
    if module in TOP or any(module.startswith(t + ".") for t in TOP):
        return "top"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else GROUND


def declared_order() -> dict[str, set[str]]:
    """Package -> the packages it declares it may import (`MAY_IMPORT` in its __init__.py, read
    as text so that reading it imports nothing); the ground may import only itself, the top
    anything."""
    allowed = {GROUND: set()}
    for init in PACKAGE.glob("*/__init__.py"):
        if init.parent.name == "records":
            continue
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["MAY_IMPORT"]:
                allowed[init.parent.name] = set(ast.literal_eval(node.value))
    return allowed


def upward_imports(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """Every import from a package to one it does not declare (a package that declares nothing
    counts as declaring nothing)."""
    wrong = []
    for name, deps in graph.items():
        here = package_of(name)
        if here == "top":
            continue
        for dep in deps:
            there = package_of(dep)
            if there not in (here, GROUND) and there not in allowed.get(here, set()):
                wrong.append(f"{name} ({here}) imports {dep} ({there})")
    return sorted(wrong)


def test_every_package_declares_what_it_may_import_and_the_order_has_no_loop():
    allowed = declared_order()
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - {"records"}
    assert packages <= set(allowed), f"packages without MAY_IMPORT: {packages - set(allowed)}"
    # the declarations themselves form one order: no package may import one that may import it
    assert_no_cycle(allowed, "packages allowed in a loop: ")


def test_no_import_runs_up_the_package_order():
    """Lazy imports count: the whole graph, read from the source."""
    wrong = upward_imports(module_imports(), declared_order())
    assert not wrong, "imports up the package order (move the code down, or pass the value in):\n" + "\n".join(wrong)


def test_a_planted_upward_import_is_found():
    """The check itself: the runtime importing a stage, and the ground importing config, are caught."""
    graph = {name: set(deps) for name, deps in module_imports().items()}
    graph["specforge_lite.runtime.compile"].add("specforge_lite.stages.door")
    graph["specforge_lite.run_folders"].add("specforge_lite.config.schema")
    wrong = upward_imports(graph, declared_order())
    assert wrong == ["specforge_lite.run_folders (ground) imports specforge_lite.config.schema (config)",
                     "specforge_lite.runtime.compile (runtime) imports specforge_lite.stages.door (stages)"]


def test_nothing_below_the_cli_imports_a_stage_or_the_records():
    for name, deps in module_imports().items():
        if package_of(name) not in ("stages", "top"):
            assert not [d for d in deps if package_of(d) in ("stages", "top")], name
        if name == "specforge_lite.contract":  # the interface decoding and the drafters both build on
            assert deps <= {"specforge_lite"}, deps


def test_only_the_command_line_imports_the_records():
    """records/ (results files, the docs made from them, the GPU check) sits on top of the package:
    it may import any module, and only `__main__` imports it."""
    graph = module_imports()
    assert "specforge_lite.records" in graph["specforge_lite.__main__"]
    for name, deps in graph.items():
        if name != "specforge_lite.__main__" and not name.startswith("specforge_lite.records"):
            assert not [d for d in deps if d.startswith("specforge_lite.records")], name


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
        if name == "specforge_lite.drafters.registry" or name.startswith("specforge_lite.drafters."):
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
    from specforge_lite.drafters.methods import ENGINE_DRAFTERS, VLLM_OF, known

    assert set(ENGINE_DRAFTERS) == set(BUILTIN)
    assert len(known()) == len(set(known())) and set(VLLM_OF.values()) <= set(known())


def test_the_package_never_imports_benchmarks():
    """benchmarks/ sits above the whole package (its scripts import specforge_lite, records
    included); nothing in the package imports it back, so the two form no loop."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n == "benchmarks" or n.startswith("benchmarks.")]
    assert found == []


# the rooms of decoding/ (its __init__ names them), lowest first: a room imports only rooms below it
DECODING_ROOMS = {"verifier": {"tree", "verify"}, "policy": {"cost", "policy"},
                  "proposers": {"request_index", "drafters", "suffix", "arctic", "hybrid"},
                  "loop": {"engine"}, "peers": {"peers"}}


def decoding_arrows_up(graph: dict[str, set[str]]) -> list[str]:
    rank = {module: (i, room) for i, (room, modules) in enumerate(DECODING_ROOMS.items()) for module in modules}
    prefix = "specforge_lite.decoding."
    wrong = []
    for name, deps in graph.items():
        if not name.startswith(prefix):
            continue
        here = rank[name.removeprefix(prefix)]
        for dep in sorted(d for d in deps if d.startswith(prefix)):
            there = rank[dep.removeprefix(prefix)]
            if there[1] != here[1] and there[0] > here[0]:
                wrong.append(f"{name} ({here[1]}) imports {dep} ({there[1]})")
            if here[1] in ("verifier", "policy") and there[1] != here[1]:
                wrong.append(f"{name} ({here[1]}) imports {dep} ({there[1]}): the {here[1]} stands alone")
    return sorted(wrong)


def test_every_decoding_module_is_in_a_room_and_no_arrow_runs_back_up():
    graph = module_imports()
    modules = {n.removeprefix("specforge_lite.decoding.") for n in graph if n.startswith("specforge_lite.decoding.")}
    assert modules == set().union(*DECODING_ROOMS.values()), "decoding modules outside the rooms (name them)"
    assert not decoding_arrows_up(graph)
    graph["specforge_lite.decoding.verify"].add("specforge_lite.decoding.engine")  # planted
    graph["specforge_lite.decoding.drafters"].add("specforge_lite.decoding.engine")
    assert decoding_arrows_up(graph) == [
        "specforge_lite.decoding.drafters (proposers) imports specforge_lite.decoding.engine (loop)",
        "specforge_lite.decoding.verify (verifier) imports specforge_lite.decoding.engine (loop)",
        "specforge_lite.decoding.verify (verifier) imports specforge_lite.decoding.engine (loop): the verifier stands alone"]


def test_every_package_docstring_names_each_of_its_modules():
    """A reader finds a module's room from its package's `__init__` docstring alone."""
    unnamed = {}
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = [p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        modules += [f"{d.name}/" for d in init.parent.iterdir() if (d / "__init__.py").exists()]
        missing = [m for m in modules if f"`{m}`" not in doc and f"`{m.rstrip('/')}`" not in doc]
        if missing:
            unnamed[str(init.parent.relative_to(PACKAGE.parent))] = sorted(missing)
    assert not unnamed, f"modules their package's docstring does not name: {unnamed}"
