"""vLLM as an evaluate engine (`serving.engines.Engine`): its methods run on the stage's
requests (`methods.run_methods`), the `vllm` section of the report (vLLM's own counters next to
our definitions, its outputs compared with our plain decoding, or with vllm_plain's where our
engine does not run), its answer rows and its Markdown."""

from __future__ import annotations

import hashlib
from pathlib import Path

from specforge_lite.drafters.methods import VLLM_METHODS, VLLM_OF
from specforge_lite.serving.vllm import load, load_report
from specforge_lite.serving.vllm.interpreter import on_gpu, single_process
from specforge_lite.serving.vllm.methods import run_methods

CONVENTIONS = {
    "vllm_mean_acceptance_length": "vLLM's own figure (what its metrics logger prints): 1 + accepted draft tokens / "
                                   "drafts, over the steps that drafted; a step with no draft (an n-gram miss) is left "
                                   "out",
    "vllm_per_position_rate": "vLLM's accepted-per-position counter / drafts: P(position i accepted), unconditional",
    "per_position_acceptance": "P(position i accepted | positions < i accepted) = accepted[i] / accepted[i-1] "
                               "(accepted[0] = drafts): our engine's definition",
    "tau": "our definition on vLLM's counters: (tokens emitted - 1 per answer) / decoding target forwards, where "
           "decoding forwards = engine iterations - 1 prefill iteration per answer (batch 1); plain = 1.00",
    "tokens_per_s": "tokens emitted / wall time of vLLM's generate call for one prompt (prefill included), batch 1, "
                    "after one warm-up call; vLLM methods run one after another after our interleaved methods",
}


def report_section(results: dict, report: dict, plain_tokens: list[list[int]] | None, cfg) -> dict:
    """vLLM's numbers next to our engine's for the same prompts (report["vllm"]); without our
    engine (`plain_tokens` None, no `plain` in report["methods"]) outputs are compared with
    vllm_plain's only and `baseline` says so."""
    k = cfg.eval.num_draft_tokens
    greedy = cfg.eval.temperature == 0
    ours = report["methods"]
    at_load_ = getattr(results, "load", None)  # `VllmResults.load`: measured where eval.concurrency asks
    failed = {name: r for name, r in results.items() if "error" in r}
    results = {name: r for name, r in results.items() if name not in failed}
    vllm_plain = results.get("vllm_plain")
    vllm_plain_rate = (sum(len(o["token_ids"]) for o in vllm_plain["outputs"])
                       / sum(o["seconds"] for o in vllm_plain["outputs"])) if vllm_plain is not None else None
    entries = {}
    for name, result in results.items():
        outputs = result["outputs"]
        tokens = sum(len(o["token_ids"]) for o in outputs)
        seconds = sum(o["seconds"] for o in outputs)
        counters = {key: sum(o["counters"][key] for o in outputs)
                    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "iterations")}
        per_pos = [0] * k
        for o in outputs:
            for i, n in enumerate(o["counters"]["accepted_per_position"][:k]):
                per_pos[i] += n
        drafts = counters["num_drafts"]
        forwards = counters["iterations"] - len(outputs)
        entry = {
            "speculative_config": result["speculative_config"], "engine_load_s": result["load_s"],
            "draft_as_read": result.get("draft_as_read"),
            "num_answers": len(outputs), "num_tokens": tokens, "wall_s": seconds,
            "tokens_per_s": tokens / seconds if seconds else None,
            "counters": {**counters, "accepted_per_position": per_pos},
            "vllm_mean_acceptance_length": 1 + counters["num_accepted_tokens"] / drafts if drafts else None,
            "vllm_per_position_rate": [n / drafts for n in per_pos] if drafts else [],
            "per_position_acceptance": ([n / prev if prev else None for n, prev in zip(per_pos, [drafts] + per_pos)]
                                        if drafts else []),
            "acceptance_rate": (counters["num_accepted_tokens"] / counters["num_draft_tokens"]
                                if counters["num_draft_tokens"] else None),
            "decoding_forwards": forwards,
            "tau": (tokens - len(outputs)) / forwards if forwards > 0 else None,
            "speedup_vs_our_plain": None, "speedup_vs_vllm_plain": None,
        }
        if entry["tokens_per_s"]:
            if "plain" in ours:
                entry["speedup_vs_our_plain"] = entry["tokens_per_s"] / ours["plain"]["tokens_per_s"]
            if vllm_plain_rate is not None:
                entry["speedup_vs_vllm_plain"] = entry["tokens_per_s"] / vllm_plain_rate
        if greedy:
            if plain_tokens is not None:
                same = [o["token_ids"] == p for o, p in zip(outputs, plain_tokens)]
                entry["identical_to_plain"] = all(same)
                entry["identical_answers"] = f"{sum(same)}/{len(same)}"
            if vllm_plain is not None:
                entry["identical_to_vllm_plain"] = all(o["token_ids"] == p["token_ids"]
                                                       for o, p in zip(outputs, vllm_plain["outputs"]))
        mirror = VLLM_OF[name]
        if mirror in ours:
            entry["ours"] = {"method": mirror, "tau": ours[mirror]["tau"], "tokens_per_s": ours[mirror]["tokens_per_s"],
                             "per_position_acceptance": ours[mirror]["per_position_acceptance"]}
            if entry["tau"] is not None and ours[mirror]["tau"] is not None:
                entry["tau_difference"] = entry["tau"] - ours[mirror]["tau"]
        entries[name] = entry
    first = next(iter(results.values()), {})
    if at_load_ and report.get("recommendation") is not None:
        report["recommendation"]["at_load"] = at_load_["advice"]
    return {"vllm_version": first.get("vllm_version"), "threads": _threads(cfg.eval.vllm),
            "baseline": "our plain" if plain_tokens is not None else "vllm_plain",
            "conventions": CONVENTIONS, "methods": entries, "failed": failed,
            **({"load": at_load_} if at_load_ else {})}


def _threads(vcfg) -> str:
    if on_gpu():
        return "GPU"
    if single_process(vcfg):
        return f"{vcfg.cpu_threads or 1}, engine and worker in one process"
    return f"{vcfg.cpu_threads} (VLLM_CPU_OMP_THREADS_BIND)" if vcfg.cpu_threads else "1 (vLLM's CPU default)"


def markdown(section: dict, k: int) -> str:
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    ours = section.get("baseline", "our plain") == "our plain"
    key, against = ("identical_to_plain", "our plain loop's") if ours else ("identical_to_vllm_plain", "vllm_plain's")
    lines = ["", f"## vLLM {section['vllm_version']} (worker threads: {section['threads']})", "",
             f"Same prompts (and turns) as above, batch 1, greedy outputs compared with {against}. "
             "tau is ours (emitted tokens / decoding forwards, bonus included) computed from vLLM's counters; "
             "vLLM's mean acceptance length is 1 + accepted / drafts.", "",
             "| method | tau | our tau (same drafter) | vLLM mean acceptance length | "
             + " | ".join(f"a{i}" for i in range(1, k + 1))
             + f" | tokens/s | our tokens/s (same drafter) | vs vLLM plain | identical to {against[:-2]} |",
             "|---|---:|---:|---:|" + "---:|" * k + "---:|---:|---:|:---:|"]
    for name, m in section["methods"].items():
        alphas = m["per_position_acceptance"] or [None] * k
        ours = m.get("ours", {})
        identical = {True: "yes", False: f"NO ({m.get('identical_answers', 'some')})", None: "n/a"}[m.get(key)]
        lines.append(f"| {name} | {f(m['tau'])} | {f(ours.get('tau'))} | {f(m['vllm_mean_acceptance_length'])} | "
                     + " | ".join(f(a) for a in alphas)
                     + f" | {f(m['tokens_per_s'], '.1f')} | {f(ours.get('tokens_per_s'), '.1f')} | "
                     f"{f(m['speedup_vs_vllm_plain'])}x | {identical} |")
    for name, failure in section["failed"].items():
        lines.append(f"\n{name} failed: {failure['error']}")
    return "\n".join(lines) + "\n"


def request_seed(base: int, *parts) -> int:
    """The seed of one vLLM request (the same rule whether our engine runs beside vLLM or not)."""
    digest = hashlib.sha256(":".join(map(str, (base, "vllm", *parts))).encode()).digest()
    return int.from_bytes(digest[:6], "big") & 0x7FFFFFFF


def answer_rows(prompts: list[dict], requests: list[list[int]], results: dict, greedy: bool) -> list[dict]:
    """One row per prompt and vLLM method that ran, in the schema of our evaluate's `answers`
    (what measurement/stats.py reads): decoding forwards = engine iterations - the prefill one;
    outputs compared with vllm_plain's (first turns: one request per prompt)."""
    base = results[Vllm.plain]["outputs"]
    rows = []
    for name, result in results.items():
        for prompt, ids, output, plain in zip(prompts, requests, result.get("outputs", []), base):
            tokens, forwards = output["token_ids"], output["counters"]["iterations"] - 1
            rows.append({"prompt_id": prompt["id"], "category": prompt["category"], "turn": 1, "method": name,
                         "num_prompt_tokens": len(ids), "num_tokens": len(tokens), "num_forwards": forwards,
                         "total_s": output["seconds"], "finish": output["finish_reason"],
                         "tau": (len(tokens) - 1) / forwards if forwards > 0 else None,
                         "tokens_per_s": len(tokens) / output["seconds"] if output["seconds"] else None,
                         "identical_to_plain": tokens == plain["token_ids"] if greedy else None})
    return rows


class VllmResults(dict):
    """Method name -> its batch-1 result (`run_methods`), and `load`: the report's `load` section or None."""

    load: dict | None = None


def at_load(cfg, methods: list[str], requests: list[list[int]], target, out: Path, seed_of,
            done: dict | None = None) -> dict:
    """The report's `vllm.load` section: every load and k measured (`done`: those the batch-1
    engines measured), each method's schedule (or eval.load_schedule) run as vLLM serves it, and
    what to deploy at eval.expected_concurrency."""
    ecfg = cfg.eval
    measured = load.measure(cfg, methods, requests, target, out, seed_of, done)
    greedy = ecfg.temperature == 0
    section = load_report.analyse(measured, ecfg.bootstrap, greedy)
    mine = [list(map(int, entry)) for entry in ecfg.load_schedule]
    schedules = {name: mine or method["schedule"] for name, method in section["methods"].items()
                 if name != load.PLAIN and method.get("schedule")}
    runs = load.measure_schedules(cfg, schedules, requests, target, out, seed_of, measured["levels"])
    load_report.add_schedule_runs(section, runs, measured, ecfg.bootstrap, greedy)
    section["schedule_source"] = "eval.load_schedule" if mine else "measured"
    section["expected_concurrency"] = ecfg.expected_concurrency
    section["advice"] = load_report.advice(section, ecfg.expected_concurrency)
    return section


class Vllm:
    """Real vLLM in a child process (`engine.py`): the `vllm_*` methods, section `vllm`."""

    name = "vllm"
    label = "vLLM"
    plain = "vllm_plain"
    conventions = CONVENTIONS

    def methods(self, method_list: list[str]) -> list[str]:
        return [m for m in method_list if m in VLLM_METHODS]

    def run(self, cfg, methods: list[str], requests: list[list[int]], target, out: Path) -> dict:
        seed_of = lambda *parts: request_seed(cfg.seed, *parts)  # noqa: E731
        if not load.wanted(cfg.eval):
            return VllmResults(run_methods(cfg, methods, requests, target, out, seed_of))
        # the same requests at every load of eval.concurrency; a method's batch-1 engine measures
        # them too where it is one of its engines at load (one engine load less per method)
        done = {}
        after = load.in_batch1_engines(cfg, methods, requests, target, seed_of, done)
        results = VllmResults(run_methods(cfg, methods, requests, target, out, seed_of, after,
                                          max(load.levels_of(cfg.eval))))
        results.load = at_load(cfg, methods, requests, target, out, seed_of, done)
        return results

    def rows(self, results: dict, prompts: list[dict], requests: list[list[int]], greedy: bool) -> list[dict]:
        return answer_rows(prompts, requests, results, greedy)

    def alone(self, cfg) -> str:
        return (f"vLLM alone, tensor_parallel_size={cfg.eval.vllm.tensor_parallel_size}; no target weights in "
                "the evaluating process")

    def report_section(self, results: dict, report: dict, plain_tokens: list[list[int]] | None, cfg) -> dict:
        return report_section(results, report, plain_tokens, cfg)

    def markdown(self, section: dict, cfg) -> str:
        return markdown(section, cfg.eval.num_draft_tokens) + (load_report.markdown(section["load"])
                                                              if section.get("load") else "")

    def config_problems(self, cfg, target_config) -> list[str]:
        return []

    def environment_problems(self, cfg) -> list[str]:
        """vLLM's interpreter, where the stage runs a vllm_* method or samples with vLLM."""
        import torch

        from specforge_lite import SpecforgeError
        from specforge_lite.serving.vllm.interpreter import require_python
        from specforge_lite.serving.vllm.methods import gpu_runner_problem
        from specforge_lite.stage_table import runs

        served = [m for m in cfg.eval.methods if m in VLLM_METHODS]
        problems = []
        if runs(cfg.stage, "evaluate") and (gpu_only := gpu_runner_problem(served, torch.cuda.is_available())):
            problems.append(gpu_only)
        for key, needed, vcfg in (("eval.methods", served and runs(cfg.stage, "evaluate"), cfg.eval.vllm),
                                  ("sample.backend=vllm", cfg.sample.backend == "vllm" and runs(cfg.stage, "sample"),
                                   cfg.sample.vllm)):
            if needed:
                try:
                    require_python(vcfg.python)
                except SpecforgeError as err:
                    problems.append(f"{key}" + (f" {served}" if key == "eval.methods" else "") + f": {err}")
        return problems

    def failures(self, section: dict, out: Path) -> list[str]:
        """A vLLM method that failed fails the stage once the report is written."""
        lines = []
        if (section.get("load") or {}).get("failed"):
            lines.append("vLLM at load failed: " + "; ".join(f"{n}: {e}" for n, e in section["load"]["failed"].items())
                         + f" (the rest is in the report; vLLM's log: {out / 'vllm.log'})")
        if not section["failed"]:
            return lines
        return lines + ["vLLM methods failed: " + "; ".join(f"{n}: {r['error']}" for n, r in section["failed"].items())
                + f" (the rest is in the report; vLLM's log: {out / 'vllm.log'})"]
