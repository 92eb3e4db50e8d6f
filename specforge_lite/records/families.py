"""The family x stage x engine table (docs/ENGINES.md "Target families"), from the tests' own run.

    python -m specforge_lite families      # make families: runs the family tests, records, renders

It runs the tests that build a tiny random target of each family users bring (tests/families.py)
and take it through the stages and forwards: tests/integration/test_families.py (every stage on
the forward evaluate chose for it, transformers' cache rolled back past a sliding window) and
tests/unit/test_static_families.py (our static and compiled forward against transformers' on the
families it covers). Each test's outcome per family, and the forward evaluate used with its reason
(recorded by the test itself as a JUnit property), go to benchmarks/results/families.json; the
table is rendered from that file by `python -m specforge_lite docs`. Nothing is typed by hand: a
family added to tests/families.py is a row once this runs again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.records.results import ROOT, write_results

TESTS = ["tests/integration/test_families.py", "tests/unit/test_static_families.py"]
# test function -> the table's column
COLUMNS = {
    "test_every_stage_runs_each_family_on_its_forward": "stages",
    "test_dflash_runs_every_stage_on_each_family": "dflash",
    "test_the_runner_rolls_back_chains_and_trees_past_the_window": "hf_rollback",
    "test_static_forward_equals_transformers_over_steps_and_crops": "static",
    "test_compiled_forward_equals_transformers": "compiled",
    "test_a_tree_verify_gives_each_branch_its_chain_logits": "static_tree",
    "test_greedy_speculative_decoding_is_plain_decoding": "static_identity",
    "test_what_a_family_cannot_run_is_refused_at_the_door": "door",
}
COMMAND = "python -m specforge_lite families"


def outcomes(junit: Path) -> dict:
    """{family: {column: outcome, "engine": ..., "fallback": ...}} from a pytest JUnit file."""
    families: dict = {}
    for case in ET.parse(junit).iter("testcase"):
        match = re.fullmatch(r"(\w+)\[([\w-]+)\]", case.get("name", ""))
        if not match or match[1] not in COLUMNS:
            continue
        parts = match[2].split("-")
        variant = [p for p in parts if p in ("static", "compiled")]  # the greedy test's two forwards
        family = next((p for p in parts if p not in ("static", "compiled")), None)
        if family is None:
            continue
        column = COLUMNS[match[1]] + (f"_{variant[0]}" if variant else "")
        outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                   else "skipped" if case.find("skipped") is not None else "passed")
        row = families.setdefault(family, {})
        row[column] = outcome
        for prop in case.iter("property"):
            row[prop.get("name")] = prop.get("value")
    return families


def main(argv: list[str] | None = None) -> int:
    """Run the family tests (every stage and forward on each family's tiny random target) and record
    the family x stage x engine table in benchmarks/results/families.json."""
    import argparse

    argparse.ArgumentParser(prog="python -m specforge_lite families", description=main.__doc__).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="families_") as work:
        junit = Path(work) / "junit.xml"
        # the tests' folders under `work` too: removed with it, not left in the system's temp folder
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS,
                               f"--basetemp={Path(work) / 'tests'}", f"--junitxml={junit}", "-o",
                               "junit_family=xunit1"], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if not junit.exists():
            raise SpecforgeError(f"the family tests wrote no results (pytest exit status {proc.returncode})")
        families = outcomes(junit)
    if not families:
        raise SpecforgeError("the family tests ran no family test: nothing to record")
    path = write_results("families", {"command": COMMAND, "tests": TESTS, "families": families,
                                      "all_passed": proc.returncode == 0})
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"families: {len(families)} families recorded in {shown}"
          + ("" if proc.returncode == 0 else f"; some tests failed (pytest exit status {proc.returncode})"))
    return 0 if proc.returncode == 0 else 1


def table(d: dict) -> list[str]:
    """The rendered block: one row per family, each cell a test's outcome on it."""
    def cell(row, *columns):
        seen = [row[c] for c in columns if c in row]
        return "-" if not seen else "yes" if all(s == "passed" for s in seen) else "FAILED" \
            if "failed" in seen else "skipped"

    lines = [f"From the family tests' own run (`{COMMAND}`, `make families`), {d.get('date', '?')[:10]} on "
             f"{d.get('machine', '?')}, commit {d['commit'][:10]}: each cell is a test's outcome on "
             "that family's tiny random target (tests/families.py); `-`: the test does not run on that family "
             "(the reason is in the last column).", "",
             "| family | sample, train, evaluate, export: EAGLE-3 / DFlash | evaluate's forward | static vs "
             "transformers (steps, crops, tree) | compiled vs transformers | greedy identity, static / compiled | "
             "transformers' cache rolled back past its window | why not our forward |",
             "|---|---|---|---|---|---|---|---|"]
    for family, row in sorted(d["families"].items()):
        why = (row.get("fallback") or "").removeprefix("the static forward does not support ")
        stages = f"{cell(row, 'stages')} / {cell(row, 'dflash')}"
        if row.get("refused"):  # the door refuses its speculative methods (the test checks that line)
            stages, why = f"refused at the door ({cell(row, 'door')})", row["refused"]
        lines.append(f"| `{family}` | {stages} | {row.get('engine', '-')} | "
                     f"{cell(row, 'static', 'static_tree')} | {cell(row, 'compiled')} | "
                     f"{cell(row, 'static_identity_static')} / {cell(row, 'static_identity_compiled')} | "
                     f"{cell(row, 'hf_rollback')} | {why or '-'} |")
    return lines
