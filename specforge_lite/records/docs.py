"""Docs from results: the measured blocks of the recipe cards, README's "Results at a glance"
and docs/BENCHMARKS.md ordered by topic, all from benchmarks/results/*.json; and the contents
lists of README and the docs/ guides, from their headings.

    python -m specforge_lite docs            # rewrite them (make docs)
    python -m specforge_lite docs --check    # list what is stale or typed by hand; exit 1 if anything

A card or README quotes a measured figure only inside a generated block:

    <!-- results:NAME -->            (NAME = benchmarks/results/NAME.json; `glance` = the README table)
    ...written by render_block(NAME)...
    <!-- /results:NAME -->

The benchmark scripts keep writing their own sections of docs/BENCHMARKS.md
(`topics.update_doc_section`); this command writes the sections of the `make gpu-check` results
files (`gpu_section`), orders them all, drops superseded ones and writes the table of contents.

README and each docs/ guide carry their contents between `<!-- docs:contents -->` markers.
"""

from __future__ import annotations

import argparse
import re

from specforge_lite import SpecforgeError
from specforge_lite.measurement.report import k_text
from specforge_lite.records import families, gpu_section, results, topics
from specforge_lite.records.gpu_section import identity_words
from specforge_lite.records.results import ROOT, machine_name, num, read_results, shaped, with_ci
from specforge_lite.records.topics import order_benchmarks, slug

README = ROOT / "README.md"
# the reference guides README links, each with a generated contents list (BENCHMARKS.md has its own)
GUIDES = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != topics.DOC.name)
CARDS = sorted([*(ROOT / "recipes").glob("*/README.md"), *(ROOT / "recipes").glob("*/LAUNCH.md")])

BLOCK = re.compile(r"<!-- results:(?P<name>[\w.\-]+) -->\n(?P<body>.*?)<!-- /results:(?P=name) -->", re.S)

# A measured figure typed by hand: a ratio (N.NNx), a rate, a tau, a duration, a memory size.
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?x(?![\w-])"                              # N.NNx, Nx
    r"|\b\d[\d.,]*\s*(?:tokens/s|tok/s)"                     # N.N tokens/s
    r"|\btau\b[^.\n]{0,12}?\d\.\d"                           # tau N.NN, tau of N.N
    r"|\b\d+(?:\.\d+)?\s*(?:min|ms)\b"                       # N min, N.N ms
    r"|\b\d+(?:\.\d+)?\s*s\b(?!/)"                           # N s
    r"|\b\d+(?:\.\d+)?\s*(?:GiB|GB)\b(?!\s*(?:GPU|H100|A100))")  # N.N GiB (a device's size such as "80 GB GPUs" is not one)


def load(name: str) -> dict:
    return read_results(results.RESULTS / f"{name}.json")


def source_line(name: str, d: dict) -> str:
    return f"Recorded {d.get('date', 'undated')} on a {machine_name(d)} (`benchmarks/results/{name}.json`)"


# --- one evaluate report ----------------------------------------------------------------

def report_of(d: dict) -> dict | None:
    for key in ("report", "decoding"):
        if isinstance(d.get(key), dict) and "methods" in d[key]:
            return d[key]
    return None


FIGURES = ("tau", "tokens_per_s", "speedup")  # what a published row of a report's method shows


def require_figures(methods: dict, source: str, figures=FIGURES) -> None:
    """Every method of a results file carries the figures its published row shows (a figure
    measured as none is recorded as null and shown as '-'); a missing one is an error naming
    the file, never a '-' published with exit 0."""
    for method, m in methods.items():
        if absent := [f for f in figures if f not in m]:
            raise SpecforgeError(f"results file benchmarks/results/{source}.json: method {method} has no "
                                 f"{', '.join(absent)}: run again the benchmark that writes it (its section's command)")


def report_table(report: dict, source: str) -> list[str]:
    require_figures(report["methods"], source)
    settings = report.get("settings", {})
    k = k_text(settings) if "num_draft_tokens" in settings else "k = None"
    lines = [f"{report.get('num_prompts', '?')} MT-Bench first turns, greedy, batch 1, {k}, "
             f"{report.get('dtype', '?')} on {report.get('device', '?')}, {report.get('torch_threads', '?')} "
             "torch threads; intervals: 95% bootstrap over prompts.", "",
             "| method | tau | tokens/s | speedup vs plain | output = plain |", "|---|---:|---:|---:|:---:|"]
    for method, m in report["methods"].items():
        same = m.get("identical_answers") or ("yes" if m.get("identical_to_plain") else "no")
        lines.append(f"| {method} | {with_ci(m.get('tau'), m.get('tau_ci'))} | {num(m.get('tokens_per_s'), 1)} | "
                     f"{with_ci(m.get('speedup'), m.get('speedup_ci'), suffix='x')} | {same} |")
    return lines


def eval_block(name: str, d: dict) -> list[str]:
    lines = [source_line(name, d) + "."]
    for key, label in (("command", "Command"), ("eval_command", "Command")):
        if d.get(key):
            lines.append(f"{label}: `{d[key]}`.")
    wall = d.get("wall") or d.get("eval_wall")
    if wall:
        lines.append(f"Time: {wall}.")
    if d.get("note"):
        lines.append(d["note"])
    samples = d.get("samples") or {}
    if samples.get("num_rows"):
        lines.append(f"Samples: {samples['num_rows']} conversations regenerated by the target "
                     f"({samples.get('num_loss_tokens', '?')} assistant tokens).")
    for kind, t in (d.get("trained") or {}).items():
        lines.append(f"Drafter `{kind}`: {t['steps']} steps, final simulated tau {num(t.get('final_simulated_tau'))}, "
                     f"{num(t.get('tokens_per_s'), 0)} training tokens/s.")
    lines += [""] + report_table(report_of(d), name) + recommendation(report_of(d))
    if isinstance(d.get("report_at_best_k"), dict):
        lines += ["", f"The same drafters at the best k the run above estimated (`{d.get('best_k_command', '')}`):", ""]
        lines += report_table(d["report_at_best_k"], name) + recommendation(d["report_at_best_k"])
    return lines


def load_block(name: str, d: dict) -> list[str]:
    """An evaluate at load (`benchmarks/engines/bench_load.py`): our engine at batch 1, vLLM's methods
    at each load at their best k, the schedule, what to deploy at load, and tau and speedup by temperature."""
    report = report_of(d)
    require_figures(report["methods"], name)
    s, load = report["settings"], report["vllm"]["load"]
    temps = list(report.get("by_temperature") or [str(s["temperature"])])
    lines = [source_line(name, d) + ".", f"Command: `{d['command']}`.", "",
             f"{report['num_prompts']} prompts of {report['dataset']}, first turns, {s['max_new_tokens']} new tokens; "
             f"our engine at batch 1, vLLM {report['vllm'].get('vllm_version')} with 1 to {max(load['loads'])} "
             f"requests in flight; the tables at T={temps[0]}, intervals 95% bootstrap (over prompts; at load, "
             "paired over requests).", "",
             "| method (our engine, batch 1) | tau | tokens/s | speedup vs plain |", "|---|---:|---:|---:|"]
    for method, m in report["methods"].items():
        lines.append(f"| {method} | {with_ci(m.get('tau'), m.get('tau_ci'))} | {num(m.get('tokens_per_s'), 1)} | "
                     f"{with_ci(m.get('speedup'), m.get('speedup_ci'), suffix='x')} |")
    lines += ["", "| load | vLLM method | best k | per-request speedup | throughput x | tokens/s |",
              "|---:|---|---:|---:|---:|---:|"]
    for level in load["loads"]:
        for method, m in load["methods"].items():
            cell = m["by_load"][str(level)]
            if method == "vllm_plain":
                lines.append(f"| {level} | {method} | 0 | 1.00x | 1.00x | {num(cell['throughput_tokens_per_s'], 1)} |")
                continue
            best = cell["by_k"].get(str(cell["best_k"])) or max(cell["by_k"].values(),
                                                                 key=lambda c: c["throughput_tokens_per_s"] or 0)
            if cell["best_k"]:
                k, shown = str(cell["best_k"]), best
            else:  # none paid: vllm_plain serves; the fastest k's cost in brackets
                k = f"0 (k={best['k']}: {num(best['speedup'])}x)"
                shown = {**load["methods"]["vllm_plain"]["by_load"][str(level)], "speedup": 1.0, "speedup_ci": None,
                         "throughput_ratio": 1.0}
            ratio = shown.get("throughput_ratio")
            lines.append(f"| {level} | {method} | {k} | {with_ci(shown['speedup'], shown['speedup_ci'], suffix='x')} | "
                         f"{'-' if ratio is None else num(ratio) + 'x'} | {num(shown['throughput_tokens_per_s'], 1)} |")
    lines += [""] + [f"- {method}: schedule `{m['schedule']}`" for method, m in load["methods"].items()
                     if method != "vllm_plain"]
    lines += [f"- At load: {line}" for line in report.get("recommendation", {}).get("at_load") or []]
    by_t = report.get("by_temperature") or {}
    if len(by_t) > 1:
        lines += ["", "| method | " + " | ".join(f"T={t}: tau, speedup" for t in by_t) + " |",
                  "|---|" + "---:|" * len(by_t)]
        for method in by_t[temps[0]]["methods"]:
            cells = [by_t[t]["methods"].get(method) or {} for t in by_t]
            lines.append(f"| {method} | " + " | ".join(f"{num(c.get('tau'))}, {num(c.get('speedup'))}x" for c in cells)
                         + " |")
        for method in by_t[temps[0]].get("vllm_load") or {}:
            for level in load["loads"]:
                cells = [((by_t[t].get("vllm_load") or {}).get(method) or {}).get(str(level)) or {} for t in by_t]
                lines.append(f"| {method} at load {level} | " + " | ".join(
                    f"k={c.get('best_k')}, {num(c.get('speedup'))}x" for c in cells) + " |")
    return lines


def recommendation(report: dict) -> list[str]:
    rec = report.get("recommendation") or {}
    return ["", f"The report's recommendation: deploy **{rec['deploy']}**."] if rec.get("deploy") else []


def current_command(command: str) -> str:
    """A recorded command with the benchmark's module path of today (the scripts moved into group folders)."""
    def moved(m):
        found = sorted(ROOT.glob(f"benchmarks/*/{m[1]}.py"))
        return f"benchmarks.{found[0].parent.name}.{m[1]}" if found else m[0]
    return re.sub(r"benchmarks\.(\w+)(?![\w.])", moved, command)


def llamacpp_block(name: str, d: dict) -> list[str]:
    plain = d["methods"].get("llamacpp_plain", {}).get("tokens_per_s")
    lines = [source_line(name, d) + f"; llama.cpp from xllamacpp {d['xllamacpp']}, {d['threads']} threads, "
             f"target `{d['target']}`, {d['num_prompts']} MT-Bench first turns, {d['max_new_tokens']} new tokens, "
             f"greedy, k = {d['k']}. Command: `{current_command(d['command'])}`.", "",
             "| method | tau | tokens/s | x llama.cpp plain | output = plain |", "|---|---:|---:|---:|:---:|"]
    require_figures(d["methods"], name, ("tau", "tokens_per_s"))
    for method, m in d["methods"].items():
        ratio = m["tokens_per_s"] / plain if plain else None
        lines.append(f"| {method} | {with_ci(m['tau'], m.get('tau_ci'))} | "
                     f"{with_ci(m['tokens_per_s'], m.get('tokens_per_s_ci'), 1)} | {num(ratio, 2, 'x')} | "
                     f"{m.get('identical_to_plain', '-')} |")
    return lines


# --- results at a glance (README) ---------------------------------------------------------

# (recipe, engine, results file, method, docs/BENCHMARKS.md section): which rows README shows.
GLANCE = [
    ("eagle_smollm2 (`make demo`)", "ours, compiled", "eval_eagle_smollm2", "eagle3", "eval_eagle_smollm2"),
    ("eagle_smollm2, k = 1", "ours, compiled", "eval_eagle_smollm2_k1", "eagle3", "eval_eagle_smollm2_k1"),
    ("eagle_smollm2, AVX2 CPU", "ours, compiled", "eval_eagle_smollm2_avx2", "eagle3", "eval_eagle_smollm2_avx2"),
    ("n-gram lookup (no training)", "ours, compiled", "eval_eagle_smollm2", "ngram", "eval_eagle_smollm2"),
    ("peagle_smollm2", "ours, compiled", "peagle_smollm2", "peagle", "peagle"),
    ("distill_smollm2", "ours, before the packaged forward", "eval_distill_smollm2", "distilled",
     "eval_distill_smollm2"),
    ("medusa_smollm2", "ours, before the packaged forward", "eval_compare_smollm2", "medusa", "eval_compare_smollm2"),
    ("EAGLE-3, 250 steps", "llama.cpp (Q4_1 target)", "llamacpp_smollm2", "llamacpp_eagle3", "llamacpp_smollm2"),
]


def glance_row(recipe: str, engine: str, name: str, method: str, section: str) -> str:
    d = load(name)
    report = report_of(d)
    if report is not None:
        require_figures({method: report["methods"][method]}, name)
        m, k = report["methods"][method], report["settings"].get("num_draft_tokens")
        speed = with_ci(m.get("speedup"), m.get("speedup_ci"), suffix="x")
        rate = num(m.get("tokens_per_s"), 1)
    else:
        m, k = d["methods"][method], d.get("k")
        plain = d["methods"]["llamacpp_plain"]["tokens_per_s"]
        speed = num(m["tokens_per_s"] / plain, 2, "x")
        rate = with_ci(m["tokens_per_s"], m.get("tokens_per_s_ci"), 1)
    return (f"| {recipe} | {engine} | {method} | {k} | {with_ci(m.get('tau'), m.get('tau_ci'))} | {speed} | {rate} | "
            f"{machine_name(d)} | {d.get('date', '?')[:10]} | `{section}` |")


def gpu_rows(methods=("eagle3", "ngram")) -> list[str]:
    """README rows of each `make gpu-check` results file (benchmarks/results/gpu_check_<gpu>.json): its
    bf16 evaluation's speculative methods, with the identity verdicts; none where no such file exists."""
    return [row for path in sorted(results.RESULTS.glob("gpu_check_*.json"))
            for row in shaped(path.stem, gpu_file_rows, path, read_results(path), methods)]


def gpu_file_rows(path, d: dict, methods) -> list[str]:
    """The rows of one gpu-check results file (`gpu_rows`)."""
    rows = []
    step = d.get("steps", {}).get("eval_bfloat16", {})
    engine = (step.get("engine") or {}).get("used", "?")
    for method in methods:
        m = step.get("methods", {}).get(method)
        if step.get("status") != "ok" or not m:
            continue
        verdicts = identity_words(m.get("identity") or {})
        rows.append(f"| eagle_smollm2 (`make gpu-check`, bf16; {verdicts}) | ours, {engine} | "
                    f"{method} | 3 | {with_ci(m.get('tau'), m.get('tau_ci'))} | "
                    f"{with_ci(m.get('speedup'), m.get('speedup_ci'), suffix='x')} | {num(m.get('tokens_per_s'), 1)} | "
                    f"{d.get('gpu', '?')} | {d.get('date', '?')[:10]} | `{path.stem}` (results file) |")
    return rows


def glance_block() -> list[str]:
    lines = ["Headline figures on SmolLM2-135M-Instruct (fp32, MT-Bench first turns, greedy, batch 1), each from "
             "its results file; tau = tokens per target forward (plain = 1.00); speedup = tokens/s over plain "
             "decoding on the same engine in the same run, 95% bootstrap intervals over prompts (llama.cpp: "
             "intervals of tokens/s). Section: the section of docs/BENCHMARKS.md that holds the run, with its "
             "command.", "",
             "| recipe | engine | method | k | tau | speedup vs plain | tokens/s | machine | date | section |",
             "|---|---|---|---:|---:|---:|---:|---|---|---|"]
    return lines + [shaped(row[2], glance_row, *row) for row in GLANCE] + gpu_rows()


def render_block(name: str) -> str:
    """The text between `<!-- results:NAME -->` markers."""
    if name == "glance":
        lines = glance_block()
    elif name == "families":
        lines = shaped(name, families.table, load(name))
    else:
        d = load(name)
        if ((report_of(d) or {}).get("vllm") or {}).get("load"):
            lines = shaped(name, load_block, name, d)
        elif report_of(d) is not None:
            lines = shaped(name, eval_block, name, d)
        elif "xllamacpp" in d:
            lines = shaped(name, llamacpp_block, name, d)
        else:
            raise SpecforgeError(f"results file benchmarks/results/{name}.json: no card block renders it (neither an "
                                 "evaluate report nor a llama.cpp run); name another results file in the block")
    return "\n".join(lines) + "\n"


def fill_blocks(text: str) -> str:
    return BLOCK.sub(lambda m: f"<!-- results:{m['name']} -->\n{render_block(m['name'])}<!-- /results:{m['name']} -->",
                     text)


def stale_blocks(text: str) -> list[str]:
    return [m["name"] for m in BLOCK.finditer(text) if m["body"] != render_block(m["name"])]


def outside_figures(text: str) -> list[str]:
    """Measured-looking figures outside the generated blocks and outside code blocks."""
    text = BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"(?:>=|<=|at least|at most|within)\s*\d+(?:\.\d+)?x?", "", text)  # goals and tolerances
    return [m.group(0) for m in FIGURE.finditer(text)]


CONTENTS = re.compile(r"<!-- docs:contents -->\n.*?<!-- /docs:contents -->", re.S)
CODE = re.compile(r"```.*?```", re.S)


def headings(text: str) -> list[tuple[int, str]]:
    """(level, text) of the Markdown headings outside code blocks."""
    return [(len(level), head.strip()) for level, head in re.findall(r"^(#+) (.+)$", CODE.sub("", text), re.M)]


def contents(text: str) -> str:
    """A guide's contents: its `##` sections (and `###` under them), GitHub anchors."""
    seen: dict[str, int] = {}
    lines = []
    for level, head in headings(text):
        anchor = slug(head, seen)
        if level in (2, 3) and head != "Contents":
            lines.append(f"{'  ' * (level - 2)}- [{head}](#{anchor})")
    return "<!-- docs:contents -->\n" + "\n".join(lines) + "\n<!-- /docs:contents -->"


def fill_guide(text: str) -> str:
    """README or a docs/ guide with its results blocks and its contents list written."""
    return CONTENTS.sub(lambda _: contents(text), fill_blocks(text))


def duplicate_headings(text: str) -> list[str]:
    """Headings that appear more than once (their anchors would differ only by a -1 suffix)."""
    found = [head for _, head in headings(text)]
    return sorted({head for head in found if found.count(head) > 1})


def problems() -> list[str]:
    found = []
    for path in [README, *GUIDES, *CARDS]:
        text, rel = path.read_text(), path.relative_to(ROOT)
        found += [f"{rel}: block results:{name} does not match "
                  f"{'the results files it lists' if name == 'glance' else f'benchmarks/results/{name}.json'}"
                  " (make docs)" for name in stale_blocks(text)]
        if CONTENTS.search(text) and fill_guide(text) != text:
            found.append(f"{rel}: its contents list is not its sections (make docs)")
        found += [f"{rel}: figure typed outside a results block: {fig!r}" for fig in outside_figures(text)]
    doc = topics.DOC
    for path in [README, *GUIDES, doc]:
        if path.exists():
            found += [f"{path.relative_to(ROOT)}: heading {head!r} appears more than once"
                      for head in duplicate_headings(path.read_text())]
    if doc.exists() and doc.read_text() != order_benchmarks(doc.read_text()):
        found.append("docs/BENCHMARKS.md is not in topic order (make docs)")
    text = doc.read_text() if doc.exists() else ""
    for path in sorted(results.RESULTS.glob("gpu_check_*.json")):  # written here from the file the GPU machine hands back
        block = f"<!-- {path.stem} -->\n{shaped(path.stem, gpu_section.section, path.stem, read_results(path))}\n"
        if block not in text:
            found.append(f"docs/BENCHMARKS.md: section {path.stem} does not match benchmarks/results/{path.name} "
                         "(make docs)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specforge_lite docs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale or hand-typed figures, change nothing")
    args = parser.parse_args(argv)
    if args.check:
        found = problems()
        print("\n".join(found) or "docs match benchmarks/results")
        return 1 if found else 0
    for path in [README, *GUIDES, *CARDS]:
        text = path.read_text()  # read right before writing: others edit these files too
        new = fill_guide(text) if path in (README, *GUIDES) else fill_blocks(text)
        if new != text:
            path.write_text(new)
            print(f"wrote {path.relative_to(ROOT)}")
    gpu_section.write_sections()
    doc = topics.DOC
    if doc.exists():
        doc.write_text(order_benchmarks(doc.read_text()))
        print(f"wrote {doc.relative_to(ROOT)}")
    return 0
