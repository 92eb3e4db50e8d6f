"""Record every drafter family side by side on the demo: chains, their trees, and held-out tau per training minute.

    python -m benchmarks.records.record_families RUN --command "..." --wall "..."
        [--also RUN2 --also-command "..." ...] [--heldout HELDOUT --heldout-command "..."] [--train-threads 1]

RUN/eval/report.json is one evaluate at the demo's settings (its prompts, k, engine) of every
trained drafter's chain and tree methods beside plain and n-gram. Recorded from it: the
method and trees tables, each method's best k (DFlash: the drafts read out of its block),
and the goals of the trees issue and of the DFlash issue, computed here:
- trees: each tree's (tau - 1) at least 1.3x its chain's; the mixed tree (EAGLE-3 + n-gram)
  ahead of n-gram with speedup intervals apart; the report recommending it;
- DFlash: drafting ms per proposed token at most 1/3 of EAGLE-3's chain; its speedup ahead of
  EAGLE-3's and, the stretch, of n-gram's (point and intervals apart).
Each RUN2 (--also, repeatable) is another evaluate on the same prompts with another tree
shape or k (a tree that fits the chain's verify width, the drafters at their best k): its
tables, its trees goals and its DFlash goals are recorded too; the first at another k is the
cards' "at the best k" table.
HELDOUT/eval/report.json, when given, is a greedy evaluate of the same drafters on held-out
prompts (MT-Bench first turns the demo does not evaluate): each drafter's tau there, its
training CPU minutes (the rank's logged seconds in `train/metrics.json` times
`--train-threads`, the torch threads it trained with) and (tau - 1) per CPU minute.
--equal-cpu records drafters trained for the same CPU time instead of the same tokens: each
`--pilot NAME=SECONDS` is that drafter's seconds per optimizer step measured in a short pilot run
(one torch thread, beside one other training), its steps come from its train/metrics.json, and
the table shows the CPU minutes each was given (steps x pilot) beside the minutes it logged.
Writes benchmarks/results/NAME.json (default eval_families_smollm2) and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import fail, run, run_file, update_doc_section, write_results
from benchmarks.records.record_compare import training_summary
from specforge_lite.config.methods import labelled_drafters
from specforge_lite.decoding.report import k_text, methods_table, trees_table

NAME = "eval_families_smollm2"
CHAINS = ("eagle3", "medusa", "dflash", "peagle")


def _apart(a: dict, b: dict) -> bool:
    """a's speedup interval wholly above b's."""
    return bool(a.get("speedup_ci") and b.get("speedup_ci")) and a["speedup_ci"][0] > b["speedup_ci"][1]


def _rounded(value):
    """Floats to 2 decimals, inside lists too (for the doc's goal lines)."""
    if isinstance(value, float):
        return round(value, 2)
    return [_rounded(v) for v in value] if isinstance(value, list) else value


def _goal(value, met: bool, note: str = "") -> dict:
    return {"value": value, "met": bool(met), **({"note": note} if note else {})}


def tree_goals(methods: dict, recommendation: dict) -> dict:
    goals = {}
    for chain in ("ngram", *CHAINS):
        tree, base = methods.get(f"{chain}_tree"), methods.get(chain)
        if tree and base and base["tau"] > 1:
            ratio = (tree["tau"] - 1) / (base["tau"] - 1)
            goals[f"{chain}_tree_gain_ge_1.3x"] = _goal(ratio, ratio >= 1.3, "tree (tau - 1) / chain (tau - 1)")
    mixed, ngram = methods.get("eagle3_mixed_tree"), methods.get("ngram")
    if mixed and ngram:
        goals["mixed_tree_ahead_of_ngram_apart"] = _goal(
            [mixed["speedup_ci"], ngram["speedup_ci"]], _apart(mixed, ngram), "speedup intervals: mixed tree, ngram")
        goals["demo_recommends_mixed_tree"] = _goal(recommendation["deploy"],
                                                    recommendation["deploy"] == "eagle3_mixed_tree")
    return goals


def dflash_goals(methods: dict, name: str = "dflash") -> dict:
    """The DFlash issue's goals for DFlash drafter `name` (the dflash method or an extra drafter's label)."""
    dflash, eagle, ngram = methods.get(name), methods.get("eagle3"), methods.get("ngram")
    if not (dflash and eagle):
        return {}
    ratio = dflash["draft_ms_per_token"] / eagle["draft_ms_per_token"]
    at_k = f" (k {dflash['k']} / {eagle['k']})" if dflash.get("k") and eagle.get("k") else ""
    goals = {"draft_cost_per_token_le_third_of_eagle3": _goal(ratio, ratio <= 1 / 3,
                                                              f"DFlash / EAGLE-3 ms per drafted token{at_k}"),
             "speedup_ahead_of_eagle3": _goal([dflash["speedup"], eagle["speedup"]], dflash["speedup"] > eagle["speedup"],
                                              "point estimates"),
             "speedup_ahead_of_eagle3_apart": _goal([dflash["speedup_ci"], eagle["speedup_ci"]], _apart(dflash, eagle))}
    if ngram:
        goals["stretch_ahead_of_ngram_apart"] = _goal([dflash["speedup_ci"], ngram["speedup_ci"]], _apart(dflash, ngram))
    return goals


def per_minute(heldout: dict, threads: int) -> dict:
    """Held-out tau, training CPU minutes and (tau - 1) per CPU minute of each drafter the
    held-out evaluate decoded (its drafter folder's train/metrics.json)."""
    dirs = drafter_folders(heldout)
    rows = {}
    for name, m in heldout["methods"].items():
        metrics = Path(dirs[name]).parent / "metrics.json" if dirs.get(name) else None
        if metrics is None or not metrics.exists():
            continue
        logged = json.loads(metrics.read_text())
        minutes = sum(r["seconds"] for r in logged["throughput"]["ranks"]) * threads / 60
        rows[name] = {"tau": m["tau"], "tau_ci": m.get("tau_ci"), "train_cpu_min": minutes,
                      "train_tokens": logged["tokens_seen"], "gain_per_cpu_min": (m["tau"] - 1) / minutes}
    return rows


def drafter_folders(report: dict) -> dict:
    """Method -> trained drafter folder of a report: eval.drafter_dirs and eval.extra_drafters labels."""
    settings = report["settings"]
    return {**(settings.get("drafter_dirs") or {}), **labelled_drafters(settings)}


def named_seconds(items: list[str], option: str) -> dict:
    """`NAME=SECONDS` items as {name: seconds}; a malformed one stops with one line."""
    out = {}
    for item in items:
        name, _, seconds = item.partition("=")
        try:
            out[name] = float(seconds)
        except ValueError:
            fail(f"{option} {item!r}: give NAME=SECONDS")
    return out


def equal_cpu(dirs: dict, pilots: list[str], process_cpu: list[str], threads: int) -> dict:
    """Per drafter of `dirs` with a `--pilot NAME=SECONDS`: its steps, the CPU minutes they make
    at the pilot's seconds per step, the training minutes it logged and, where given, its
    process's CPU minutes."""
    rates, used = named_seconds(pilots, "--pilot"), named_seconds(process_cpu, "--process-cpu")
    rows = {}
    for name, rate in rates.items():
        if not dirs.get(name):
            fail(f"--pilot {name}: the evaluate decoded no drafter of that name")
        logged = json.loads((Path(dirs[name]).parent / "metrics.json").read_text())
        steps = logged["total_steps"]
        rows[name] = {"steps": steps, "pilot_s_per_step": rate, "cpu_min_given": steps * rate * threads / 60,
                      "train_min_logged": sum(r["seconds"] for r in logged["throughput"]["ranks"]) * threads / 60,
                      "tokens": logged["tokens_seen"], "process_cpu_min": used[name] / 60 if name in used else None}
    return rows


def brief(report: dict) -> dict:
    """A report without its per-answer rows (the main run keeps them; the tables need none)."""
    return {k: v for k, v in report.items() if k != "answers"}


def at_best_k(report: dict, others: list[tuple[str, dict]]) -> dict:
    """The first other run at another k, as the cards' results blocks show it (`benchmarks/docs.py`:
    `report_at_best_k`, `best_k_command`)."""
    k = k_text(report["settings"])
    for command, other in others:
        if k_text(other["settings"]) != k:
            return {"report_at_best_k": other, "best_k_command": command}
    return {}


def best_k_lines(report: dict) -> str:
    lines = []
    for name, m in report["methods"].items():
        best = m.get("best_k")
        if best and best.get("best_k"):
            lines.append(f"- `{name}`: best k = {best['best_k']}, expected {best['expected_speedup']:.2f}x plain "
                         f"(estimated from its per-position acceptance and the measured forward costs)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--command", required=True, help="the evaluate that made RUN")
    parser.add_argument("--wall", default="", help="its wall time, as measured")
    parser.add_argument("--also", type=Path, action="append", default=[],
                        help="another evaluate (another tree shape or k) on the same prompts; repeatable")
    parser.add_argument("--also-command", action="append", default=[], help="its command, one per --also")
    parser.add_argument("--heldout", type=Path, help="a greedy evaluate of the same drafters on held-out prompts")
    parser.add_argument("--heldout-command", default="")
    parser.add_argument("--train-threads", type=int, default=1, help="the torch threads the drafters trained with")
    parser.add_argument("--name", default=NAME, help="the results file and BENCHMARKS section")
    parser.add_argument("--equal-cpu", action="store_true", help="the drafters trained for equal CPU time (--pilot)")
    parser.add_argument("--pilot", action="append", default=[], metavar="NAME=SECONDS",
                        help="a drafter's seconds per step in its pilot run (--equal-cpu); repeatable")
    parser.add_argument("--train-command", action="append", default=[], metavar="COMMAND",
                        help="a command that trained one of the drafters, listed with the budget; repeatable")
    parser.add_argument("--dflash", action="append", default=[], metavar="METHOD",
                        help="a DFlash method whose goals are computed (default: dflash); repeatable")
    parser.add_argument("--process-cpu", action="append", default=[], metavar="NAME=SECONDS",
                        help="a drafter's training process CPU seconds (user + sys, start-up included); repeatable")
    args = parser.parse_args()
    args.dflash = args.dflash or ["dflash"]
    report = run_file(args.run_dir, "eval/report.json")
    methods, rec = report["methods"], report["recommendation"]

    def label(r: dict) -> str:  # a run's k, and its tree shape where it ran tree methods
        tree = r["settings"]["tree"]
        shape = "/".join(str(tree[k]) for k in ("depth", "branch", "nodes"))
        trees = any(m.get("tree") for m in r["methods"].values())
        return k_text(r["settings"]).replace(" = ", "=") + (f", trees {shape}" if trees else "")

    if len(args.also_command) != len(args.also):
        fail("give one --also-command per --also")
    runs = [report] + [run_file(d, "eval/report.json") for d in args.also]
    goals = {}
    for r in runs:
        goals[f"trees ({label(r)})"] = tree_goals(r["methods"], r["recommendation"])
        for name in args.dflash:
            goals[f"{name} ({label(r)})"] = dflash_goals(r["methods"], name)
    goals = {key: group for key, group in goals.items() if group}
    heldout = per_minute(run_file(args.heldout, "eval/report.json"), args.train_threads) if args.heldout else {}
    dirs = drafter_folders(report)
    trained = {m: training_summary(Path(d)) for m, d in dirs.items() if d and m in methods}
    budget = equal_cpu(dirs, args.pilot, args.process_cpu, args.train_threads) if args.equal_cpu else {}
    write_results(args.name, {"budget": budget, "command": args.command, "wall": args.wall, "heldout_command": args.heldout_command,
                         "train_threads": args.train_threads, "train_commands": args.train_command, "goals": goals, "heldout": heldout,
                         "trained": trained, "report": report,
                         "also": [{"command": c, "report": brief(r)} for c, r in zip(args.also_command, runs[1:])],
                         **at_best_k(report, [(c, brief(r)) for c, r in zip(args.also_command, runs[1:])])})
    engine = report["settings"].get("engine") or {}
    engine = (f"{engine.get('used')} target forward (tree verify width {engine.get('tree_width')}), "
              f"drafters {', '.join(f'{n} {h}' for n, h in (engine.get('drafters_graph') or {}).items()) or 'eager'}")
    goal_lines = "\n".join(f"- {issue}: {key}: {json.dumps(_rounded(g['value']))} -> {'met' if g['met'] else 'NOT met'}"
                           + (f" ({g['note']})" if g.get("note") else "")
                           for issue, group in goals.items() for key, g in group.items())
    also_section = ""
    for command, also in zip(args.also_command, runs[1:]):
        arec = also["recommendation"]
        also_section += (f"\n\nThe same prompts at {label(also)}, `{command}`:\n\n"
                         f"{methods_table(also)}\n\n{trees_table(also)}\n\n"
                         f"Recommendation: deploy **{arec['deploy']}**: {'; '.join(arec['reasons'])}.")
    heldout_table = ""
    if heldout:
        heldout_table = ("\n\nHeld-out prompts (`" + args.heldout_command + "`), against training cost ("
                         f"logged train seconds x {args.train_threads} thread(s)):\n\n"
                         "| drafter | held-out tau [CI] | training CPU min | training tokens | (tau - 1) per CPU min |\n"
                         "|---|---:|---:|---:|---:|\n"
                         + "\n".join(f"| {n} | {r['tau']:.2f} [{r['tau_ci'][0]:.2f}, {r['tau_ci'][1]:.2f}] | "
                                     f"{r['train_cpu_min']:.0f} | {r['train_tokens']} | {r['gain_per_cpu_min']:.4f} |"
                                     for n, r in heldout.items()))
    budget_table = ""
    if budget:
        budget_table = ("\n\nTraining budget: each drafter trained for the steps that its pilot's seconds per step "
                        "make the same CPU time (one torch thread each):\n\n"
                        "| drafter | steps | pilot s/step | CPU min given | training min logged (wall) | "
                        "process CPU min | tokens |\n"
                        "|---|---:|---:|---:|---:|---:|---:|\n"
                        + "\n".join(f"| {n} | {b['steps']} | {b['pilot_s_per_step']:.2f} | {b['cpu_min_given']:.1f} | "
                                     f"{b['train_min_logged']:.1f} | "
                                     f"{'-' if b['process_cpu_min'] is None else format(b['process_cpu_min'], '.1f')} | "
                                     f"{b['tokens']} |" for n, b in budget.items()))
        if args.train_command:
            budget_table += "\n\nTrained by:\n\n" + "\n".join(f"- `{c}`" for c in args.train_command)
    title = ("Drafters at equal training CPU minutes" if budget else "Every drafter family, chains and trees")
    update_doc_section(args.name, f"""## {title}: `{args.run_dir.name}` (SmolLM2, CPU)

Command: `{args.command}` ({args.wall}). Evaluation: {report['num_prompts']} MT-Bench first turns, greedy,
{k_text(report['settings'])}, {engine}, batch 1, methods interleaved per prompt.

{methods_table(report)}

{trees_table(report)}

Best k per method:
{best_k_lines(report)}

Recommendation (computed by the report): deploy **{rec['deploy']}**: {'; '.join(rec['reasons'])}.{also_section}{budget_table}{heldout_table}

Goals of the trees issue and of the DFlash issue, from these runs:
{goal_lines}
""")
    print(json.dumps(goals, default=str))


if __name__ == "__main__":
    run(main)
