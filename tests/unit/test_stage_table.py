"""The stages are listed once, in specforge_lite/stage_table.py: no other module holds a
table of stage names, the table names exactly the modules in stages/, and the readers (CLI,
schema, validation, launcher, sizing) answer from it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from omegaconf import OmegaConf

from specforge_lite.stage_table import COMMANDS, ORDER, RUN, STAGES, chained, runs

PACKAGE = Path(__file__).resolve().parents[2] / "specforge_lite"
TABLE = PACKAGE / "stage_table.py"


def stage_name_tables(source: str) -> list[tuple[int, list[str]]]:
    """(line, names) of every tuple / list / set / dict literal in `source` holding two or
    more stage names (or `run`) as string constants: a table of stages kept by hand."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [*(k for k in node.keys if k is not None), *node.values]
        else:
            continue
        names = sorted({i.value for i in items if isinstance(i, ast.Constant) and i.value in COMMANDS})
        if len(names) >= 2:
            found.append((node.lineno, names))
    return found


def test_the_scan_finds_a_table_of_stage_names():
    # the dict's keys, and the tuple ("sample", "train") among its values
    assert len(stage_name_tables('WRITES = {"sample": ("sample",), "train": ("sample", "train")}\n')) == 2
    assert stage_name_tables('if cfg.stage in ("evaluate", "run"): pass\n') == [(1, ["evaluate", "run"])]
    assert stage_name_tables('rows = ("features", "train"); x = cfg.stage == "run"\n') == []


def test_no_module_but_the_stage_table_lists_stage_names():
    tables = {f"{path.relative_to(PACKAGE.parent)}:{line}": names
              for path in sorted(PACKAGE.rglob("*.py")) if path != TABLE
              for line, names in stage_name_tables(path.read_text())}
    assert not tables, f"stage names listed outside specforge_lite/stage_table.py (read the table): {tables}"


def test_the_table_names_exactly_the_stage_modules():
    # stages/ holds the stage modules, the door (door.py), the runner (__init__.py) and the stages'
    # helpers: what decides a trained drafter's reuse (train_keys.py), the samples' dtype record
    # (sample_dtype.py), the target generating for the sample stage (sample_backends.py), which
    # decoder each evaluate method runs (evaluate_decoders.py) and the evaluate report's body
    # (evaluate_entries.py)
    on_disk = {f"specforge_lite.stages.{p.stem}" for p in (PACKAGE / "stages").glob("*.py")
               if p.stem not in ("__init__", "door", "train_keys", "sample_dtype", "sample_backends",
                                 "evaluate_decoders", "evaluate_entries")}
    assert {s.module for s in STAGES} == on_disk
    for stage in STAGES:
        assert stage.module.rsplit(".", 1)[1] == stage.name
        assert callable(importlib.import_module(stage.module).run)


def test_the_table_is_consistent():
    assert ORDER == tuple(s.name for s in STAGES) and list(COMMANDS) == [*ORDER, RUN.name]
    assert len({s.folder for s in STAGES}) == len(STAGES)
    assert RUN.module is None and RUN.writes == ORDER and chained(RUN.name) == STAGES
    for stage in STAGES:
        assert set(stage.writes) <= set(ORDER) and stage.name in stage.writes
        assert chained(stage.name) == (stage,) and runs(RUN.name, stage.name)
    assert not runs("export", "evaluate") and runs("evaluate", "evaluate")


def test_the_readers_answer_from_the_table(compose_cfg, tmp_path):
    from specforge_lite.__main__ import _usage
    from specforge_lite.run_folders import stage_dir
    from specforge_lite.config.schema import Config
    from specforge_lite.stages.door import environment_problems
    from specforge_lite.scale.launch import single_process_reason

    usage = _usage()
    for stage in COMMANDS.values():
        assert f"  {stage.name:<9} {stage.help}" in usage
    assert OmegaConf.structured(Config).stage in COMMANDS
    cfg = compose_cfg(["+recipe=smoke", f"run_dir={tmp_path}", "sample.backend=hf", "trainer.num_processes=2"])
    for stage in STAGES:
        assert stage_dir(cfg, stage.name) == tmp_path / stage.folder
        assert (single_process_reason(cfg, stage.name) is None) == stage.multi_rank
    # every folder a command writes is checked before it starts: train writes the samples too
    (tmp_path / "samples").rmdir()
    (tmp_path / "samples").write_text("")
    for stage in COMMANDS.values():
        cfg.stage = stage.name
        flagged = any("samples" in p for p in environment_problems(cfg))
        assert flagged == ("sample" in stage.writes), stage.name
