"""benchmarks/: scripts in group folders that only measure and record, one listing (`make bench`),
one harness (benchmarks/common.py, writing through specforge_lite.records). No test imports them:
this one reads them as text and runs them as child processes; what they share with the product
(timing, intervals, results files, run files) is tested in the package."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specforge_lite import SpecforgeError
from specforge_lite.drafters.registry import DRAFTERS
from specforge_lite.records import docs, results, runs, timing

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
GROUPS = {"decoding", "engines", "peers", "records", "sampling", "training"}
TOP_LEVEL = {"__init__.py", "__main__.py", "common.py"}  # the listing and the harness
OWN_ENVIRONMENT = {"benchmarks.peers.train_speculators"}  # runs in the peer trainer's venv, not ours
RECIPES = ROOT / "specforge_lite" / "conf" / "recipe"

MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                 for p in BENCH.glob("*/*.py") if p.name != "__init__.py")


def source(module: str) -> str:
    return (ROOT / (module.replace(".", "/") + ".py")).read_text()


def docstring(module: str) -> str:
    return ast.get_docstring(ast.parse(source(module))) or ""


def imported(path: Path) -> set[str]:
    """The modules a file imports, anywhere in it (an import inside a function counts)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def test_every_benchmark_sits_in_a_group_folder():
    assert {p.name for p in BENCH.glob("*.py")} == TOP_LEVEL
    folders = {p.name for p in BENCH.iterdir() if p.is_dir() and p.name not in ("results", "__pycache__")}
    assert folders == GROUPS
    for group in GROUPS:
        assert ast.get_docstring(ast.parse((BENCH / group / "__init__.py").read_text())), group
    assert {m.split(".")[1] for m in MODULES} == GROUPS


@pytest.mark.parametrize("module", MODULES)
def test_benchmark_has_a_one_line_docstring(module):
    """(Each imports: `test_every_benchmark_answers_help_and_runs_nothing` runs every one.)"""
    first = docstring(module).split("\n\n")[0]
    assert first and "\n" not in first, f"{module}: the docstring's first paragraph is one line"
    assert len(first) <= 120 and first[-1] in ".?:", first


@pytest.mark.parametrize("module", sorted(set(MODULES) - OWN_ENVIRONMENT))
def test_benchmark_runs_through_the_harness(module):
    """`run(main)` under `__main__` (a SpecforgeError: one line, exit 2), and no path of the flat folder."""
    text = source(module)
    guard = [n for n in ast.parse(text).body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guard and ast.unparse(guard[0].body[-1]) == "run(main)", module
    assert "from benchmarks.common import" in text
    assert not re.search(r"benchmarks[./](bench_|record_|peer\b|compare_runs|dry_run|plot_learning)", text), module


HELP_ALL = """
import contextlib, io, json, runpy, sys
codes = {}
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        codes[module] = 0
    except SystemExit as stop:
        codes[module] = stop.code or 0
    codes[module] = [codes[module], bool(out.getvalue().strip())]
print(json.dumps(codes))
"""


def test_every_benchmark_answers_help_and_runs_nothing():
    """`--help` prints usage and exits 0, for every script (one child process: torch imported once)."""
    before = {p: p.stat().st_mtime_ns for p in (BENCH / "results").glob("*.json")}
    modules = sorted(set(MODULES) - OWN_ENVIRONMENT)
    done = subprocess.run([sys.executable, "-c", HELP_ALL, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {m: [0, True] for m in modules}
    assert {p: p.stat().st_mtime_ns for p in (BENCH / "results").glob("*.json")} == before


def test_listing_shows_each_benchmark_once_with_its_group_and_summary():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines() if line.startswith(tuple(GROUPS))]
    assert sorted(module for _, module, _ in rows) == MODULES  # each once
    for group, module, summary in rows:
        assert module.split(".")[1] == group
        assert summary == docstring(module).split("\n")[0]
    assert [module for _, module, _ in rows] == MODULES  # by group, then module


def test_make_bench_prints_the_listing():
    made = subprocess.run(["make", "-s", "bench"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert all(module in made for module in MODULES)


# --- what the scripts import ---------------------------------------------------------------

def test_no_test_imports_benchmarks():
    """Tests test the package; a benchmark script is run as a child process, never imported."""
    found = [f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / "tests").rglob("*.py"))
             for name in sorted(imported(path)) if name == "benchmarks" or name.startswith("benchmarks.")]
    assert found == []


def test_scripts_reach_drafters_through_the_registry():
    """A script that needs a drafter's package asks `drafter_module(NAME)`, never imports it."""
    packages = {f"specforge_lite.drafters.{name}" for name in DRAFTERS}
    found = [f"{path.relative_to(ROOT)}: {name}" for path in sorted(BENCH.rglob("*.py"))
             for name in sorted(imported(path)) if name in packages or name.rpartition(".")[0] in packages]
    assert found == []


def test_scripts_leave_the_docs_generator_and_the_gpu_check_to_the_package():
    """benchmarks/ measures and records; the docs and the GPU check are `python -m specforge_lite docs |
    gpu-check`, and the Makefile runs those."""
    makefile = (ROOT / "Makefile").read_text()
    assert "$(PY) -m specforge_lite docs" in makefile and "$(PY) -m specforge_lite gpu-check $(ARGS)" in makefile
    assert "benchmarks.docs" not in makefile and "gpu_check" not in makefile


# --- the harness's one-line errors ---------------------------------------------------------

@pytest.mark.parametrize("argv, line", [
    (["benchmarks.sampling.bench_sample_backends", "--recipe", "nope"], "error: unknown recipe 'nope'; known: "),
    (["benchmarks.records.record_eval", "NO_RUN", "--command", "make demo"],
     "error: NO_RUN/eval/report.json not found; `python -m specforge_lite evaluate run_dir=NO_RUN"),
    (["benchmarks.training.bench_learning_curve", "train", "nope"], "error: unknown recipe 'nope'; known: before, "),
    (["benchmarks.training.bench_eagle3_options"], "error: no step given; known: features, record, run\n"),
])
def test_script_errors_are_one_line_and_exit_2(argv, line):
    env = {k: v for k, v in os.environ.items() if k != "SPECFORGE_LITE_DEBUG"}  # that one adds the traceback
    done = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(line) and done.stderr.count("\n") == 1, done.stderr


def test_an_unknown_recipe_lists_the_known_ones():
    done = subprocess.run([sys.executable, "-m", "benchmarks.sampling.bench_sample_backends", "--recipe",
                           "eagle_smolm2"], cwd=ROOT, capture_output=True, text=True)
    message = done.stderr.strip()
    assert done.returncode == 2 and message.startswith("error: unknown recipe 'eagle_smolm2'; known: "), message
    assert set(message.split("known: ")[1].split(", ")) == {p.stem for p in RECIPES.glob("*.yaml")}


def test_missing_run_file_names_the_stage_that_writes_it(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(SpecforgeError) as err:
        runs.run_file(run_dir, "eval/report.json")
    assert str(err.value) == (f"{run_dir}/eval/report.json not found; `python -m specforge_lite evaluate "
                              f"run_dir={run_dir} (with the overrides that made the run)` makes it")
    with pytest.raises(SpecforgeError, match=r"`python -m benchmarks.training.bench_scaling` makes it$"):
        results.load_results("no_such_results_file", "python -m benchmarks.training.bench_scaling")
    (run_dir / "train").mkdir(parents=True)
    (run_dir / "train" / "metrics.json").write_text(json.dumps({"history": [{"step": 1}]}))
    assert runs.run_file(run_dir, "train/metrics.json") == {"history": [{"step": 1}]}


# --- timing and intervals ------------------------------------------------------------------

def test_timed_and_median_ms():
    result, seconds = timing.timed(lambda: sum(range(1000)))
    assert result == 499500 and seconds >= 0
    assert timing.median_ms([0.003, 0.001, 0.002]) == pytest.approx(2.0)


def test_interleaved_counts_every_round_against_the_baseline():
    totals, ratios = timing.interleaved({"base": lambda: 10, "double": lambda: 20}, rounds=3, baseline="base")
    assert [totals[m][0] for m in ("base", "double")] == [30, 60]
    assert len(ratios["double"]) == 3 and ratios["base"] == [1.0, 1.0, 1.0]


def test_with_ci_formats_a_value_and_its_interval():
    assert results.with_ci(1.234, [1.1, 1.35]) == "1.23 [1.10, 1.35]"
    assert results.with_ci(2.0, None, suffix="x") == "2.00x"
    assert results.with_ci(None, [1, 2]) == "-"


def answers(method: str, per_prompt: dict) -> list[dict]:
    """report.json answer rows: per prompt id, (tokens, decoding forwards) of one answer."""
    return [{"prompt_id": pid, "method": method, "num_tokens": tokens, "num_forwards": forwards, "total_s": 1.0}
            for pid, (tokens, forwards) in per_prompt.items()]


def test_paired_tau_difference_is_zero_on_equal_runs_and_hand_computed_otherwise():
    same = answers("eagle3", {"a": (11, 5), "b": (21, 10)})
    assert runs.paired_tau_difference(same, same, "eagle3") == {"difference": 0.0, "ci": [0.0, 0.0],
                                                                 "num_prompts": 2}
    # tau = (tokens - 1 per answer) / forwards: 30 / 10 = 3.0 against 30 / 15 = 2.0; prompt "c" only in one run
    better = answers("eagle3", {"a": (16, 5), "b": (16, 5), "c": (99, 1)})
    worse = answers("eagle3", {"a": (16, 8), "b": (16, 7)})
    diff = runs.paired_tau_difference(better, worse, "eagle3")
    assert diff["num_prompts"] == 2 and diff["difference"] == pytest.approx(1.0)
    assert diff["ci"][0] <= 1.0 <= diff["ci"][1]
    with pytest.raises(SpecforgeError, match="no prompt answered by both medusa and medusa"):
        runs.paired_tau_difference(better, worse, "medusa")
    # two methods of one run: the same pairing, the rows of each method
    one_run = better + answers("medusa", {"a": (16, 8), "b": (16, 7)})
    assert runs.paired_tau_difference(one_run, one_run, "eagle3", "medusa") == diff


def test_recorded_commands_render_with_todays_module_paths():
    """Results files keep the command of their run; the docs print it with the module as it is now."""
    named = set()
    for path in sorted((BENCH / "results").glob("*.json")):
        command = json.loads(path.read_text()).get("command")
        if isinstance(command, str):
            named |= set(re.findall(r"benchmarks\.[\w.]+", docs.current_command(command)))
    assert named and named <= set(MODULES), named - set(MODULES)
    assert (docs.current_command("python -m benchmarks.bench_llamacpp --k 3")
            == "python -m benchmarks.engines.bench_llamacpp --k 3")
    assert docs.current_command("python -m benchmarks.nothing --check") == "python -m benchmarks.nothing --check"
