"""docs/BENCHMARKS.md's section of each `make gpu-check` results file (benchmarks/results/gpu_check_<gpu>.json).

The GPU machine hands back only its results file; `python -m specforge_lite docs` (`make docs`)
writes its section here from that file.
"""

from __future__ import annotations

import re

from specforge_lite.measurement.identity import verdict_text
from specforge_lite.records import results
from specforge_lite.records.results import read_results, shaped, with_ci
from specforge_lite.records.topics import update_doc_section

COMMAND = "python -m specforge_lite docs"


def identity_words(identity: dict) -> str:
    """The verdicts' sentence (`identity.verdict_text`), from the counts where the file has them
    (an earlier file's own sentence called answers within rounding identical)."""
    if all(isinstance(identity.get(v), int) for v in ("identical", "rounding", "mismatch")):
        return verdict_text(identity["identical"], identity["rounding"], identity["mismatch"])
    old = re.fullmatch(r"\d+/\d+: (\d+) identical, (\d+) rounding, (\d+) mismatch", identity.get("text") or "")
    return verdict_text(*map(int, old.groups())) if old else identity.get("text") or "-"


def eval_rows(record: dict) -> list[str]:
    rows = []
    for name, m in record.get("methods", {}).items():
        share = m.get("draft_time_share")
        rows.append(f"| {record['dtype']} | {name} | {with_ci(m.get('tau'), m.get('tau_ci'))} | "
                    f"{with_ci(m.get('speedup'), m.get('speedup_ci'), suffix='x')} | {m.get('tokens_per_s', 0):.0f} | "
                    f"{'n/a' if share is None else f'{share:.0%}'} | {identity_words(m.get('identity') or {})} |")
    return rows


def runs_of(steps: dict) -> list[dict]:
    """The runs a record's steps come from, each with its steps (a step of an older file without
    a run record counts as a run of unknown commit, told apart by its date)."""
    runs: dict = {}
    for name, record in steps.items():
        run = record.get("run") or {"date": record.get("date"), "commit": None, "tree_clean": None}
        key = (run.get("date"), run.get("commit"), run.get("tree_clean"))
        runs.setdefault(key, {**run, "steps": []})["steps"].append(name)
    return list(runs.values())


def incomplete(d: dict) -> list[str]:
    """Why a record's steps do not make one complete check (none: they do, if every step ran):
    failed or skipped steps (an older file's vLLM probe that found no vLLM counted as ok), steps
    of different or unknown commits or of a changed tree, or an older file's steps that say neither."""
    steps = d.get("steps", {})
    skipped = [n for n, r in steps.items() if r.get("status") == "skipped"
               or (n == "vllm_tree" and r.get("status") == "ok" and r.get("vllm", True) is None)]
    runs = d.get("runs") or runs_of(steps)
    why = [f"failed: {', '.join(d['failed_steps'])}"] if d.get("failed_steps") else []
    why += [f"skipped: {', '.join(skipped)}"] if skipped else []
    if steps and not any(r.get("run") for r in steps.values()):
        why.append("recorded before each step named its run: which steps ran together, and on which commit, "
                   "is unknown")
    elif len({r.get("commit") for r in runs}) > 1 or any(not r.get("commit") for r in runs):
        why.append(f"steps of different or unknown commits ({runs_text(runs)})")
    elif any(r.get("tree_clean") is False for r in runs):
        why.append("measured on a tree with uncommitted changes")
    return why


def runs_text(runs: list[dict]) -> str:
    return "; ".join(f"{r.get('date')}, {(r.get('commit') or '')[:10] or 'commit unknown'}: {', '.join(r['steps'])}"
                     for r in runs)


def completeness(d: dict) -> str:
    """'yes' (and which runs of the one commit its steps come from, when several), or 'no' with why."""
    why = incomplete(d)
    if d.get("complete") and not why:
        runs = d.get("runs") or runs_of(d.get("steps", {}))
        return "yes" + (f" (steps from {len(runs)} runs of one commit: {runs_text(runs)})" if len(runs) > 1 else "")
    return "no (" + "; ".join(why or ["not every step ran"]) + ")"


def section(slug: str, d: dict) -> str:
    steps = d.get("steps", {})
    lines = [f"`make gpu-check` on one {d.get('gpu', '?')} ({d.get('gpu_memory_gib', '?')} GiB), torch "
             f"{d.get('torch', '?')}, CUDA {d.get('cuda', '?')}; results file `{slug}.json`, rendered by `{COMMAND}`. "
             f"Complete: {completeness(d)}.", "",
             "| step | status | date | seconds | limit (s) |", "|---|---|---|---|---|"]
    limits = d.get("limits_s", {})
    for name, r in steps.items():
        lines.append(f"| {name} | {r.get('status')} | {r.get('date', d.get('date', '?'))} | {r.get('seconds', '?')} | "
                     f"{limits.get(name, '?')} |")
    train = [(name, steps[name]) for name in ("train_batch1", "train_batched") if name in steps]
    if train:
        lines += ["", "Training (the demo recipe, online EAGLE-3, bf16 autocast):", "",
                  "| step | batch | steps | training tokens/s | peak GPU memory (GiB) |", "|---|---|---|---|---|"]
        for name, r in train:
            tps = r.get("tokens_per_s")
            lines.append(f"| {name} | {' '.join(r.get('overrides', []))} | {r.get('steps', '?')} | "
                         f"{'n/a' if tps is None else f'{tps:,.0f}'} | {r.get('peak_memory_gib', 'n/a')} |")
    evals = [steps[name] for name in ("eval_bfloat16", "eval_float32") if steps.get(name, {}).get("methods")]
    if evals:
        lines += ["", "Decoding (MT-Bench first turns, 128 tokens, k = 3, greedy; prompts: "
                  + ", ".join(f"{r['dtype']} {r.get('prompts')} ({r.get('engine', {}).get('used', '?')} engine)"
                              for r in evals) + "):", "",
                  "| dtype | method | tau | speedup | tokens/s | drafting share | identical to plain |",
                  "|---|---|---|---|---|---|---|"]
        for r in evals:
            lines += eval_rows(r)
        engine = evals[0].get("engine", {})
        if engine.get("measured_ms"):
            lines += ["", f"Target forward, ms (bf16; eval.engine=auto times each engine, compiling took "
                          f"{engine.get('compile_s') or 0:.0f} s):", "", "| engine | width 1 | width 4 |", "|---|---|---|"]
            for name, ms in engine["measured_ms"].items():
                lines.append(f"| {name} | {ms.get('1', 0):.2f} | {ms.get('4', 0):.2f} |")
    projection = steps.get("projection", {}).get("shapes", {})
    if projection:
        lines += ["", f"Projections at real shapes ({steps['projection'].get('label', 'projection')}):", "",
                  "| shape | engine | forward ms, width 1 | demo's acceptance: best k, speedup | "
                  "tau 3 at k = 3: best k, speedup |", "|---|---|---|---|---|"]
        for name, p in projection.items():
            pro = p.get("projections", {})
            demo, stated = pro.get("demo_measured", {}), pro.get("stated_tau3_at_k3", {})
            lines.append(f"| {name} | {p.get('engine', '?')} | {p.get('forward_ms_by_width', {}).get('1', 0):.2f} | "
                         f"{demo.get('best_k', '?')}, {demo.get('expected_speedup', 0):.2f}x | "
                         f"{stated.get('best_k', '?')}, {stated.get('expected_speedup', 0):.2f}x |")
    return "\n".join(lines)


def write_sections() -> None:
    """The section of every gpu_check_*.json results file, written into docs/BENCHMARKS.md."""
    for path in sorted(results.RESULTS.glob("gpu_check_*.json")):
        update_doc_section(path.stem, shaped(path.stem, section, path.stem, read_results(path)))
        print(f"docs/BENCHMARKS.md: section {path.stem}")
