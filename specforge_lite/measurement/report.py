"""The evaluation report read by people: a Markdown page and PNG plots."""

from __future__ import annotations

from pathlib import Path

from specforge_lite.config.draft_tokens import own_draft_tokens, widest_k
from specforge_lite.measurement.identity import verdict_text
from specforge_lite.measurement.stats import bootstrap_settings


def _fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _with_interval(value, interval, unit: str = "") -> str:
    """"1.23x [1.10, 1.37]"; the value alone for reports written before intervals existed."""
    text = _fmt(value) + (unit if value is not None else "")
    return text + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def k_text(settings) -> str:
    """"k = 3", or "k = 3 (dflash 1, eagle3 1)" where eval.method_draft_tokens gives some methods their own k."""
    mine = ", ".join(f"{method} {k}" for method, k in own_draft_tokens(settings).items())
    return f"k = {settings['num_draft_tokens']}" + (f" ({mine})" if mine else "")


def methods_table(report: dict) -> str:
    """One row per method: the table to paste into docs, with each method's bootstrap
    intervals and the prompts / tokens / target forwards behind its figures."""
    k = widest_k(report["settings"])
    level = f"{bootstrap_settings(report['settings'])['level']:.0%}"
    lines = [f"| method | tau [{level} CI] | accept rate | " + " | ".join(f"a{i}" for i in range(1, k + 1))
             + f" | tokens/s | speedup [{level} CI] | prompts / tokens / forwards | identical to plain "
             "| draft / verify time | loop overhead ms/step |",
             "|---|---:|---:|" + "---:|" * k + "---:|---:|---:|:---:|---:|---:|"]
    for name, m in report["methods"].items():
        alphas = (m["per_position_acceptance"] + [None] * k)[:k]  # a method at a smaller k: "-" beyond it
        share = (f"{100 * m['draft_time_share']:.0f}% / {100 * m['verify_time_share']:.0f}%"
                 if m["draft_time_share"] is not None else "-")
        identical = identity_cell(m)
        counts = " / ".join(str(value) for value in (m.get("num_prompts", report.get("num_prompts", "-")),
                                                     m.get("num_tokens", "-"), m.get("num_target_forwards", "-")))
        lines.append(f"| {name} | {_with_interval(m['tau'], m.get('tau_ci'))} | {_fmt(m['acceptance_rate'])} | "
                     + " | ".join(_fmt(a) for a in alphas)
                     + f" | {_fmt(m['tokens_per_s'], '.1f')} | {_with_interval(m['speedup'], m.get('speedup_ci'), 'x')}"
                     f" | {counts} | {identical} | {share} | {_fmt(m['overhead_ms_per_step'], '.2f')} |")
    return "\n".join(lines)


def calibration_lines(report: dict) -> list[str]:
    """Per chain method whose drafter gave confidences: predicted against measured acceptance per position."""
    rows = {name: m["confidence_calibration"] for name, m in report["methods"].items()
            if m.get("confidence_calibration")}
    if not rows:
        return []
    out = ["## Confidence calibration", "", report["conventions"].get("confidence_calibration", "") + ".", "",
           "| method | " + " | ".join(f"i={c['position']}: predicted / measured (steps)"
                                     for c in max(rows.values(), key=len)) + " |",
           "|---|" + "---:|" * max(len(r) for r in rows.values())]
    for name, cells in rows.items():
        out.append(f"| {name} | " + " | ".join(f"{_fmt(c['predicted'])} / {_fmt(c['measured'])} ({c['steps']})"
                                               for c in cells) + " |")
    return out + [""]


def categories_table(report: dict, methods: list[str]) -> str:
    """tau / speedup over plain per prompt category (`per_category_tau`), a column per method."""
    lines = ["| category | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for cat, taus in report["per_category_tau"].items():
        speeds = {m: (report["methods"][m].get("per_category") or {}).get(cat, {}).get("speedup") for m in methods}
        lines.append(f"| {cat} | " + " | ".join(_fmt(taus.get(m)) + ("" if speeds[m] is None else f" / {speeds[m]:.2f}x")
                                               for m in methods) + " |")
    return "\n".join(lines)


def sources_table(report: dict) -> str:
    """One row per hybrid method (its `sources`, decoding/hybrid.py): the share of its steps each
    source drafted, and the tokens the target kept per step of each. Empty without hybrids."""
    rows = []
    for name, m in report["methods"].items():
        sources = m.get("sources")
        if not sources:
            continue
        steps = sum(s["steps"] for s in sources.values()) or 1
        none = sources.get("none", {"steps": 0})
        cut = sources["drafter"].get("cut")  # drafted tokens the cut left unverified (older reports: not counted)
        rows.append(f"| {name} | " + " | ".join(
            f"{100 * s['steps'] / steps:.0f}% ({s['steps']}) | {_fmt(s['accepted'] / s['steps'] if s['steps'] else None)}"
            for s in (sources["lookup"], sources["drafter"])) + f" | {'-' if cut is None else cut} | "
            f"{100 * none['steps'] / steps:.0f}% ({none['steps']}) |")
    if not rows:
        return ""
    return "\n".join(["| method | lookup: steps | lookup: kept / step | drafter: steps | drafter: kept / step | "
                      "drafter: tokens cut | no draft: steps |", "|---|---:|---:|---:|---:|---:|---:|", *rows])


def trees_table(report: dict) -> str:
    """One row per tree method (its `tree` fields, `choices.tree_fields`) beside the chain
    it grows from: tau and speedup with their intervals, nodes verified and path accepted per
    step, the drafting and verify shares of decode time, and the best tree shape estimated
    from its steps. Empty when the report has no tree method."""
    methods = report["methods"]
    trees = {name: m for name, m in methods.items() if m.get("tree")}
    if not trees:
        return ""
    level = f"{bootstrap_settings(report['settings'])['level']:.0%}"
    lines = [f"| tree method | depth / branch / nodes | tau [{level} CI] | speedup [{level} CI] | its chain: tau / "
             "speedup | nodes verified / step | path / step | draft / verify time | best tree (estimated) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in trees.items():
        tree, chain = m["tree"], methods.get(m["tree"]["chain"])
        shape = tree["shape"]
        beside = f"{_fmt(chain['tau'])} / {_fmt(chain['speedup'])}x" if chain else "not run"
        share = (f"{100 * m['draft_time_share']:.0f}% / {100 * m['verify_time_share']:.0f}%"
                 if m["draft_time_share"] is not None else "-")
        best = tree["best_tree"]["best"]
        estimate = (f"{best['depth']} / {best['branch']} / {best['nodes']}: {best['expected_speedup']:.2f}x"
                    if best else "-")
        speedup = _with_interval(m["speedup"], m.get("speedup_ci"), "x")
        lines.append(f"| {name} | {shape['depth']} / {shape['branch']} / {shape['nodes']} | "
                     f"{_with_interval(m['tau'], m.get('tau_ci'))} | {speedup} | {beside} | {_fmt(tree['nodes_per_step'])} | {_fmt(tree['path_per_step'])} | {share} | "
                     f"{estimate} |")
    return "\n".join(lines)


def best_tree_lines(report: dict) -> list[str]:
    """The "Best tree" section: per tree method the estimated speed of each candidate shape,
    and how the estimate was made (`metrics.best_tree`)."""
    out = []
    for name, m in report["methods"].items():
        estimate = (m.get("tree") or {}).get("best_tree")
        if not estimate or not estimate["table"]:
            continue
        rows = ", ".join(f"{r['depth']}/{r['branch']}/{r['nodes']}: {r['expected_tokens_per_s']:.1f} tok/s "
                         f"({r['expected_speedup']:.2f}x{', as run' if r['measured'] else ''})"
                         for r in estimate["table"])
        best = estimate["best"]
        alphas = ", ".join(_fmt(a) for a in m["tree"]["per_depth_acceptance"])
        out.append(f"- **{name}**: best tree (estimated) = depth {best['depth']}, branch {best['branch']}, "
                   f"{best['nodes']} nodes (per-depth acceptance of the accepted path: {alphas}; expected by "
                   f"depth / branch / nodes: {rows})")
    if not out:
        return []
    return (["## Best tree", "",
             "Estimated, as best k is, from each tree method's own steps: the same branch and node budget cut at "
             "a smaller depth keeps the measured tree's first levels, so its accepted path is at least the measured "
             "one cut there (a lower bound on its acceptance); a step verifies no more nodes than the measured step "
             "did, priced at the measured forward cost of that width times what this method's tree verifies paid "
             "over chain forwards. Smaller node budgets and branches cannot be derived (which ranks the accepted "
             "path used is not recorded) and are not estimated.", ""] + out + [""])


def identity_cell(m: dict) -> str:
    """The "identical to plain" cell: the verdict counts ("no mismatch 24/24 (15 identical, 9 within
    rounding)", NO first when one is a mismatch); in reports without verdicts yes, NO (n/N) or n/a."""
    counts = m.get("identity")
    if counts is None:
        return {True: "yes", False: f"NO ({m.get('identical_answers')})", None: "n/a"}[m.get("identical_to_plain")]
    words = verdict_text(counts["identical"], counts["rounding"], counts["mismatch"])
    return ("NO: " if counts["mismatch"] else "") + words


def identity_notes(report: dict) -> list[str]:
    """The paragraph under the tables when an answer differs from plain's: what rounding means and
    whether a mismatch fails the report."""
    counted = {n: m["identity"] for n, m in report["methods"].items() if m.get("identity")}
    baseline = report.get("rounding_baseline")  # what the machine's rounding alone does to plain
    if all(c["identical"] == c["answers"] for c in counted.values()):
        if any(m.get("identical_to_plain") is False for m in report["methods"].values()):  # an older report
            return ["Outputs differ from plain decoding in " + report.get("dtype", "?") + ".", ""]
        return [baseline["text"], ""] if baseline else []
    rule = next(iter(counted.values()))["rule"]
    text = (f"Greedy answers that differ from plain decoding's ({report.get('dtype', '?')}) are classified at their "
            f"first differing token; {rule} (a width-k verify forward rounds differently from k one-token forwards, "
            "so near-tied choices flip: not a verifier error).")
    bad = [n for n, c in counted.items() if c["mismatch"]]
    text += (f" MISMATCH in {', '.join(bad)}: a token the target clearly did not choose; the report fails."
             if bad else " No mismatch: every difference is within rounding.")
    if baseline:
        text += " " + baseline["text"]
    return [text, ""]


# what each method is, for the recommendation's wording (trained drafters add their own
# `SERVING_NOTE`, passed in by the evaluate stage)
def _engine_sentence(engine: dict | None) -> str:
    """' Target forward: ...' from the report's settings.engine (empty where absent)."""
    if not engine or not engine.get("used"):
        return ""
    how = f" (eval.engine={engine['requested']})" if engine.get("requested") != engine["used"] else ""
    text = f" Target forward: `{engine['used']}`{how}"
    if dtype := engine.get("dtype"):  # target.dtype=auto on a CPU: measured, or why not
        why = f": {dtype['reason']}" if dtype["requested"] == "auto" else ""
        text += f" in {dtype['used']} (target.dtype={dtype['requested']}{why})"
    if engine["used"] == "compiled" and engine.get("compile_s") is not None:
        verb = "loaded from the graph cache" if engine.get("graph") == "loaded" else "compiled"
        text += f", its graphs {verb} in {engine['compile_s']:.1f} s before timing"
        if engine.get("autotune") is False:
            text += " (SPECFORGE_LITE_AUTOTUNE=0: inductor's default kernels, not autotuned ones)"
    graphs, fallback = engine.get("drafters_graph") or {}, engine.get("drafters_fallback") or {}
    drafting = [f"{name} eager ({fallback[name]})" if name in fallback else
                f"{name} {'loaded' if graphs.get(name) == 'loaded' else 'compiled'} in {seconds:.1f} s"
                for name, seconds in (engine.get("drafters_compile_s") or {}).items()]
    if drafting:
        text += "; drafting graphs: " + ", ".join(drafting)
    return text + "."


def flatness(ms_by_width: dict) -> str:
    """What the widest forward costs over one token (verifying k + 1 tokens pays where it stays near 1)."""
    widths = sorted(ms_by_width, key=int)
    if len(widths) < 2 or not ms_by_width[widths[0]]:
        return ""
    return f" The widest, t={widths[-1]}, costs {ms_by_width[widths[-1]] / ms_by_width[widths[0]]:.2f}x the one-token forward."


def served_by(engine: dict | None) -> str:
    """Which target forward served each width (the compiled graph, or the eager module where timing
    found it faster: settings.engine.widths), with both forwards' times where the eager one serves."""
    routed = (engine or {}).get("widths") or {}
    serves, ms = routed.get("serves") or {}, routed.get("ms") or {}
    if not serves:
        return ""
    eager = [int(w) for w, forward in serves.items() if forward == "eager"]
    if not eager:
        return f" Widths 1..{max(map(int, serves))} ran on the compiled graph (timed faster than the eager module at each)."
    eager_ms, compiled_ms = ({int(w): v for w, v in (ms.get(name) or {}).items()} for name in ("eager", "compiled"))
    timed = "; ".join(f"t={w}: eager {eager_ms[w]:.1f} ms, compiled {compiled_ms[w]:.1f} ms"
                      for w in sorted(eager) if w in eager_ms and w in compiled_ms)
    return (f" The eager module served t={', '.join(map(str, sorted(eager)))} (faster there than the compiled graph: "
            f"{timed}); the compiled graph the other widths up to {max(map(int, serves))}.")


def render_markdown(report: dict) -> str:
    s = report["settings"]
    mode = "greedy" if s["temperature"] == 0 else f"sampling T={s['temperature']}, top-p={s['top_p']}"
    methods = list(report["methods"])
    out = [
        "# Speculative decoding evaluation", "",
        f"Target `{report['target']}` ({report['dtype']}, {report['device']}, {report['torch_threads']} threads); "
        f"{report['num_prompts']} prompts of `{report['dataset']}` ({report['num_answers']} answers), "
        f"{s['max_new_tokens']} new tokens max, {mode}, {k_text(s)}, batch 1, "
        f"{s['warmup']} warm-up run(s) per method." + _engine_sentence(s.get("engine")), "",
        *[f"**Defect** ({name}): {reason}; its figures below are of eager drafting.\n"
          for name, reason in ((s.get("engine") or {}).get("drafters_fallback") or {}).items()],
        *([f"**Busy machine**: {report['machine_drift']['text']}.\n"] if report.get("machine_drift") else []),
        methods_table(report), "",
    ]
    if trees := trees_table(report):
        out += ["Tree methods (`eval.tree`) beside the chains they grow from; nodes verified / step is the verify "
                "width less the pending token, path / step the drafts accepted.", "", trees, ""]
    corpus = report.get("suffix_corpus")
    if corpus and corpus["samples_asked"] and not corpus["tokens"]:
        out += ["**No samples of this target**: eval.suffix.samples=true, but no samples of this target were found, "
                "so suffix lookup drafted from each request alone.", ""]
    elif corpus and corpus["tokens"]:
        out += [f"Suffix lookup's corpus: {corpus['tokens']} tokens of the target's sampled answers beside each "
                "request.", ""]
    if sources := sources_table(report):
        out += ["Hybrid methods (`<drafter>_hybrid`): the steps each source drafted (or none, a plain step) and the "
                "tokens the target kept per step of each.", "", sources, ""]
    rec = report.get("recommendation")
    if rec:
        out += ["## Recommendation", "", f"Deploy **{rec['deploy']}**: " + "; ".join(rec["reasons"]) + "."]
        out += [f"- {line}" for line in rec["alternatives"]]
        out += [f"- At load (vLLM): {line}" for line in rec.get("at_load") or []] + [""]
    conventions = report["conventions"]
    out += [
        "tau: " + conventions["tau"] + ". a_i: " + conventions["per_position_acceptance"]
        + ". Speedup: " + conventions["speedup"] + "."
        + (" Intervals: " + conventions["intervals"] + "." if "intervals" in conventions else ""), "",
        "## tau and speedup by category", "", categories_table(report, methods),
    ]
    costs = report["forward_costs"]
    out += ["", "## Best k", "",
            f"Target forward over t new tokens at context {costs['context_len']}: "
            + ", ".join(f"t={t}: {ms:.1f} ms" for t, ms in costs["ms_by_num_tokens"].items()) + "."
            + flatness(costs["ms_by_num_tokens"]) + served_by(s.get("engine"))
            + (f" The forward was {costs['note']}." if costs.get("note") else "")
            + (f" Best k prices them at what plain decoding paid a forward in this run ({costs['decoding_scale']:.2f}x "
               "the timing above)." if costs.get("decoding_scale", 1.0) != 1.0 else ""), ""]
    for name, m in report["methods"].items():
        if "best_k" not in m:
            continue
        bk = m["best_k"]
        rows = ", ".join(f"k={r['k']}: {r['expected_tokens_per_s']:.1f} tok/s ({r['expected_speedup']:.2f}x)"
                         for r in bk["table"])
        out.append(f"- **{name}**: best k = {bk['best_k']} (expected tokens/s by k: {rows or 'n/a'})")
    out += ["", f"`best_k` = **{report['best_k']}** (from {report['best_k_method']}); the export stage reads it "
            "from report.json.", ""]
    out += best_tree_lines(report)
    out += calibration_lines(report)
    out += identity_notes(report)
    for plot in report.get("plots", []):
        out.append(f"![{plot}]({plot})")
    return "\n".join(out) + "\n"


def write_plots(report: dict, out_dir: Path) -> list[str]:
    """acceptance_by_position.png, tau_by_category.png, tokens_per_s.png; returns the names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in report["methods"].items():
        alphas = m["per_position_acceptance"]
        if alphas:
            ax.plot(range(1, len(alphas) + 1), [a if a is not None else float("nan") for a in alphas],
                    marker="o", label=name)
    ax.set(xlabel="draft position i", ylabel="P(accepted | earlier accepted)", ylim=(0, 1.02),
           title="Acceptance by draft position")
    ax.set_xticks(range(1, widest_k(report["settings"]) + 1))
    ax.legend() if ax.lines else None
    names.append(_save(fig, out_dir, "acceptance_by_position.png"))

    cats = list(report["per_category_tau"])
    methods = list(report["methods"])
    fig, ax = plt.subplots(figsize=(max(6, len(cats) * 1.2), 4))
    width = 0.8 / len(methods)
    for j, name in enumerate(methods):
        taus = [report["per_category_tau"][c].get(name) or 0 for c in cats]
        ax.bar([i + j * width for i in range(len(cats))], taus, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set(ylabel="tau (tokens per target forward)", title="tau by category")
    ax.legend(fontsize=8)
    names.append(_save(fig, out_dir, "tau_by_category.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [report["methods"][m]["tokens_per_s"] for m in methods]
    ax.bar(methods, rates)
    ax.axhline(report["methods"]["plain"]["tokens_per_s"], color="k", linestyle="--", linewidth=1)
    ax.set(ylabel="tokens/s", title="Decoding speed (dashed: plain)")
    ax.tick_params(axis="x", rotation=30)
    names.append(_save(fig, out_dir, "tokens_per_s.png"))
    return names


def _save(fig, out_dir: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(Path(out_dir) / name, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name
