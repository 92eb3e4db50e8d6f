"""llama.cpp as an evaluate engine (`serving.engines.Engine`), and the `llamacpp` section of
an evaluate report: llama.cpp's methods (`methods.run_methods`) on the report's own requests,
tau from llama.cpp's draft counters, intervals by the report's paired bootstrap over prompts
(`measurement.stats`), outputs compared with `llamacpp_plain` on the same target file."""

from __future__ import annotations

from specforge_lite import SpecforgeError
from specforge_lite.measurement.stats import (
    method_intervals,
    percentile_interval,
    prompt_totals,
    resample_indices,
    tokens_per_s,
)
from specforge_lite.drafters.methods import LLAMACPP_METHODS
from specforge_lite.serving.llamacpp.methods import PLAIN, run_methods

CONVENTIONS = {
    "tau": "tokens emitted by decoding forwards / decoding target forwards, from llama.cpp's counters: each answer's "
           "first token comes from the prompt forward, every later forward emits its accepted drafts + 1, so "
           "forwards = tokens - 1 - draft_n_accepted; plain = 1.00 (the report's definition)",
    "tokens_per_s": "tokens emitted / wall time of the whole request (prompt included), batch 1, after warm-up; "
                    "exactly max_new_tokens per answer (end of sequence ignored)",
    "speedup_vs_llamacpp_plain": "tokens/s over llamacpp_plain's on the same prompts and target file (paired "
                                 "bootstrap interval)",
    "speedup_vs_our_plain": "tokens/s over our plain loop's (another engine, target precision and answer lengths: "
                            "a rough comparison)",
    "identical_to_llamacpp_plain": "greedy tokens equal llamacpp_plain's on the same target GGUF (never compared "
                                   "with the PyTorch target)",
    "order": "llama.cpp methods run one after another after our interleaved methods, each on its own server",
}


def report_section(run: dict, report: dict, cfg) -> dict:
    """report["llamacpp"] from `methods.run_methods`' result and the report written so far."""
    boot = cfg.eval.bootstrap
    prompt_of = [row["prompt_id"] for row in report["answers"] if row["method"] == "plain"]
    done = {m: r["completions"] for m, r in run["results"].items() if "completions" in r}
    failed = {m: {"error": r["error"]} for m, r in run["results"].items() if "error" in r}
    entries = {}
    if PLAIN in done:
        rows = [{"prompt_id": prompt_of[i], "method": m, "num_tokens": len(c.tokens), "total_s": c.wall_seconds,
                 "num_forwards": max(0, len(c.tokens) - 1 - c.accepted)}
                for m, completions in done.items() for i, c in enumerate(completions)]
        totals = prompt_totals(rows)
        intervals = method_intervals(totals, PLAIN, boot.resamples, boot.seed, boot.level)
        indices = resample_indices(totals[PLAIN].num_prompts, boot.resamples, boot.seed)
        plain_rate = float(tokens_per_s(totals[PLAIN]))
        for method, completions in done.items():
            tokens = sum(len(c.tokens) for c in completions)
            accepted = sum(c.accepted for c in completions)
            drafted = sum(c.drafted for c in completions)
            forwards = float(totals[method].forwards.sum())
            rate = float(tokens_per_s(totals[method]))
            same = [c.tokens == p.tokens for c, p in zip(completions, done[PLAIN])]
            entries[method] = {
                "spec_type": run["results"][method]["spec_type"], "draft_gguf": run["results"][method]["draft_gguf"],
                "num_answers": len(completions), "num_tokens": tokens,
                "wall_s": sum(c.wall_seconds for c in completions),
                "tokens_per_s": rate,
                "tokens_per_s_ci": percentile_interval(tokens_per_s(totals[method], indices), boot.level),
                "decode_tokens_per_s": tokens / sum(c.seconds for c in completions),
                "drafted": drafted, "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                "decoding_forwards": forwards,
                "tau": (tokens - len(completions)) / forwards if forwards else None,
                "tau_ci": intervals[method]["tau_ci"],
                "speedup_vs_llamacpp_plain": rate / plain_rate,
                "speedup_vs_llamacpp_plain_ci": intervals[method]["speedup_ci"],
                "speedup_vs_our_plain": rate / report["methods"]["plain"]["tokens_per_s"],
                "identical_to_llamacpp_plain": all(same) if cfg.eval.temperature == 0 else None,
                "identical_answers": f"{sum(same)}/{len(same)}",
            }
    return {"xllamacpp": run["xllamacpp"], "threads": run["threads"], "target_gguf": run["target_gguf"],
            "target_precision": run["target_precision"], "conventions": CONVENTIONS, "methods": entries,
            "failed": failed}


def markdown(section: dict) -> str:
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    ci = lambda v, spec=".2f": "" if not v else f" ({format(v[0], spec)}-{format(v[1], spec)})"  # noqa: E731
    lines = ["", f"## llama.cpp (xllamacpp {section['xllamacpp']}, {section['threads']} threads, target "
                 f"{section['target_gguf']}, {section['target_precision']})", "",
             "Same requests (prompts and turns) as above, batch 1, greedy, exactly max_new_tokens each; tau from "
             "llama.cpp's draft counters; outputs compared with llamacpp_plain on the same target file. "
             "Intervals: paired bootstrap over prompts.", "",
             "| method | llama.cpp drafter | tau | tokens/s | vs llama.cpp plain | vs our plain | "
             "identical to llama.cpp plain |",
             "|---|---|---:|---:|---:|---:|:---:|"]
    for name, m in section["methods"].items():
        same = {True: "yes", False: f"NO ({m['identical_answers']})", None: "n/a"}[m["identical_to_llamacpp_plain"]]
        lines.append(f"| {name} | {m['spec_type'] or '-'} | {f(m['tau'])}{ci(m['tau_ci'])} | "
                     f"{f(m['tokens_per_s'], '.1f')}{ci(m['tokens_per_s_ci'], '.1f')} | "
                     f"{f(m['speedup_vs_llamacpp_plain'])}x{ci(m['speedup_vs_llamacpp_plain_ci'])} | "
                     f"{f(m['speedup_vs_our_plain'])}x | {same} |")
    for name, failure in section["failed"].items():
        lines.append(f"\n{name} failed: {failure['error']}")
    return "\n".join(lines) + "\n"


class LlamaCpp:
    """llama.cpp in process (xllamacpp) on the target's GGUF: the `llamacpp_*` methods, section
    `llamacpp`. It measures beside our engine only: its section reads our plain answers."""

    name = "llamacpp"
    label = "llama.cpp"
    plain = PLAIN
    conventions = CONVENTIONS

    def methods(self, method_list: list[str]) -> list[str]:
        return [m for m in method_list if m in LLAMACPP_METHODS]

    def run(self, cfg, methods: list[str], requests: list[list[int]], target, out) -> dict:
        return run_methods(cfg, methods, requests, target.path)

    def rows(self, results: dict, prompts: list[dict], requests: list[list[int]], greedy: bool) -> list[dict]:
        raise SpecforgeError("llama.cpp methods run beside our engine only: add plain to eval.methods")

    def alone(self, cfg) -> str:
        raise SpecforgeError("llama.cpp methods run beside our engine only: add plain to eval.methods")

    def report_section(self, results: dict, report: dict, plain_tokens, cfg) -> dict:
        return report_section(results, report, cfg)

    def markdown(self, section: dict, cfg) -> str:
        return markdown(section)

    def config_problems(self, cfg, target_config) -> list[str]:
        """export.gguf's drafter (its aux layers once the target is known), xllamacpp, draft GGUFs."""
        from specforge_lite.serving.llamacpp import checks

        return checks.gguf_export_problems(cfg, target_config) + checks.method_problems(cfg)

    def environment_problems(self, cfg) -> list[str]:
        return []

    def failures(self, section: dict, out) -> list[str]:
        """A llama.cpp method that failed fails the stage once the report is written."""
        if not section["failed"]:
            return []
        return ["llama.cpp methods failed: " + "; ".join(f"{n}: {r['error']}" for n, r in section["failed"].items())]
