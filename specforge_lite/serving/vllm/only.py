"""An evaluate without our engine: the vllm_* methods only, measured against vllm_plain.

For a target our engine cannot hold on one device (a 70B target on one H100), the evaluate
stage runs this when every method of `eval.methods` is a vllm_* method
(`eval_methods.engine_needed`): this process reads the target's config, tokenizer and
prompts only and holds none of its weights (recorded for the rehearsal's accounting);
vLLM holds the target with `eval.vllm.tensor_parallel_size`. vllm_plain is the baseline
(added when missing): tau, tokens/s and speedup with their bootstrap intervals
(decoding/stats.py), and greedy outputs compared with vllm_plain's.

First turns only: a later turn follows the target's own plain answer to the one before,
and here there is no plain answer of ours to follow; the report says how many turns
were left out.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict

import torch
from omegaconf import DictConfig, OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.scale.accounting import record_no_target
from specforge_lite.artifacts import atomic_write_json, atomic_write_text, stage_dir, write_provenance
from specforge_lite.data.chat import prompt_ids, require_chat_template
from specforge_lite.data.eval_prompts import conversation, fitting_prompts, load_prompts, select_prompts
from specforge_lite.decoding.report import recommend
from specforge_lite.decoding.stats import method_intervals, prompt_totals, speed_ratio, tau, tokens_per_s
from specforge_lite.config.methods import vllm_only_methods
from specforge_lite.serving.vllm import engine as vllm_engine, report as vllm_report
from specforge_lite.target.loading import load_target_config, load_tokenizer, resolve_dtype, resolve_target_path

log = logging.getLogger(__name__)

BASELINE = "vllm_plain"


def request_seed(base: int, *parts) -> int:
    """The seed of one vLLM request (the same rule whether our engine runs beside vLLM or not)."""
    digest = hashlib.sha256(":".join(map(str, (base, "vllm", *parts))).encode()).digest()
    return int.from_bytes(digest[:6], "big") & 0x7FFFFFFF


def run(cfg: DictConfig) -> dict:
    """The evaluate stage without our engine; writes run_dir/eval/ and returns the report."""
    ecfg = cfg.eval
    methods = vllm_only_methods(ecfg)
    config = load_target_config(cfg.target, weights=False)
    record_no_target(config, "serving.vllm_only (config, tokenizer and prompts; the target in vLLM)")
    tokenizer = load_tokenizer(cfg.target)
    require_chat_template(tokenizer)
    prompts = select_prompts(load_prompts(cfg), ecfg.max_prompts)
    later_turns = sum(len(p["turns"]) - 1 for p in prompts)
    prompts = [{**p, "turns": p["turns"][:1]} for p in prompts]
    prompts, too_long = fitting_prompts(tokenizer, prompts, ecfg, config)
    requests = [prompt_ids(tokenizer, conversation(p, [], 0)) for p in prompts]
    path = resolve_target_path(cfg.target.path)
    eos_ids = vllm_engine.eos_ids_of(path, tokenizer)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:  # as targets.eos_token_ids
        eos_ids.append(tokenizer.eos_token_id)
    out = stage_dir(cfg, "evaluate")
    log.info("evaluating %s in vLLM alone (tensor_parallel_size=%d, no target weights in this process) on %d "
             "prompts of %s, first turns only", ", ".join(methods), ecfg.vllm.tensor_parallel_size, len(prompts),
             ecfg.dataset)
    # the dtype our engine would have loaded (auto: fp32 on a CPU, bf16 on a GPU), never vLLM's own
    # "auto", which reads the checkpoint's and may differ from the target's recorded runs
    device = torch.device("cuda" if vllm_engine.on_gpu() else "cpu")
    dtype = str(resolve_dtype(cfg.target.dtype, device)).removeprefix("torch.")
    results = vllm_engine.run_methods(cfg, methods, requests, eos_ids, None, tokenizer, out,
                                      lambda *parts: request_seed(cfg.seed, *parts), dtype=dtype)
    if "error" in results[BASELINE]:
        raise SpecforgeError(f"{BASELINE}, the baseline of an evaluate without our engine, failed: "
                             f"{results[BASELINE]['error']} (vLLM's log: {out / 'vllm.log'})")
    report = build_report(cfg, prompts, requests, results)
    report["turns"] = (f"first turns only: {later_turns} later turn(s) left out (a later turn follows the "
                       "target's plain answer, and no plain decodes in our engine here)" if later_turns
                       else "every prompt has one turn")
    report["skipped"] = {"prompt_too_long": len(too_long), "ids": too_long} if too_long else {}
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", markdown(report))
    write_provenance(out, cfg)
    for name, entry in report["methods"].items():
        log.info("%-17s tau %.2f  %.2f tokens/s  speedup %.2fx vs %s%s", name, entry["tau"] or 0,
                 entry["tokens_per_s"], entry["speedup"], BASELINE,
                 "" if entry["identical_to_plain"] in (None, True) else "  OUTPUT DIFFERS")
    rec = report["recommendation"]
    log.info("recommendation (baseline %s): deploy %s (%s); report in %s", rec["baseline"], rec["deploy"],
             "; ".join(rec["reasons"]), out / "report.md")
    vllm_report.raise_failures(report["vllm"], out / "vllm.log")
    return report


def answer_rows(prompts: list[dict], requests: list[list[int]], results: dict, greedy: bool) -> list[dict]:
    """One row per prompt and vLLM method that ran, in the schema of our evaluate's `answers`
    (what decoding/stats.py reads): decoding forwards = engine iterations - the prefill one."""
    base = results[BASELINE]["outputs"]
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


def build_report(cfg: DictConfig, prompts: list[dict], requests: list[list[int]], results: dict) -> dict:
    """The evaluate report of the vLLM methods `results` (name -> run_methods' entry: runner
    outputs, or an error) on `prompts`, their baseline vllm_plain. In `methods`, `speedup` and
    `identical_to_plain` are against vllm_plain (`baseline` says so)."""
    ecfg = cfg.eval
    greedy = ecfg.temperature == 0
    boot = ecfg.bootstrap
    rows = answer_rows(prompts, requests, results, greedy)
    totals = prompt_totals(rows)
    intervals = method_intervals(totals, BASELINE, boot.resamples, boot.seed, boot.level)
    section = vllm_report.report_section(results, {"methods": {}}, None, cfg)
    by_cat = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_cat[row["method"]][row["category"]].append(row)
    entries = {}
    for name in totals:
        same = [row["identical_to_plain"] for row in rows if row["method"] == name]
        entry = {"tau": float(tau(totals[name])), "tokens_per_s": float(tokens_per_s(totals[name])),
                 "speedup": float(speed_ratio(totals[name], totals[BASELINE])), **intervals[name],
                 "identical_to_plain": all(same) if greedy else None,
                 "identical_answers": f"{sum(same)}/{len(same)}" if greedy else None,
                 "per_position_acceptance": section["methods"][name]["per_position_acceptance"],
                 "per_category": {}}
        for cat, cat_rows in by_cat[name].items():
            mine, base = prompt_totals(cat_rows)[name], prompt_totals(by_cat[BASELINE][cat])[BASELINE]
            entry["per_category"][cat] = {"tau": float(tau(mine)), "tokens_per_s": float(tokens_per_s(mine)),
                                          "speedup": float(speed_ratio(mine, base))}
        entries[name] = entry
    categories = list(dict.fromkeys(p["category"] for p in prompts))
    report = {
        "target": cfg.target.path, "dataset": ecfg.dataset, "baseline": BASELINE,
        "engine": f"vLLM alone, tensor_parallel_size={ecfg.vllm.tensor_parallel_size}; no target weights in "
                  "the evaluating process",
        "settings": OmegaConf.to_container(ecfg, resolve=True),
        "conventions": {
            "baseline": f"{BASELINE}: speedup and identical_to_plain are against vLLM's plain decoding of the "
                        "same target (our engine does not run in this evaluate)",
            "tau": vllm_report.CONVENTIONS["tau"],
            "tokens_per_s": vllm_report.CONVENTIONS["tokens_per_s"],
            "speedup": f"tokens/s over {BASELINE}'s tokens/s, same prompts, same run",
            "intervals": f"{boot.level:.0%} percentile bootstrap over prompts ({boot.resamples} resamples, seed "
                         f"{boot.seed}), paired: the same prompts for every method",
        },
        "num_prompts": len(prompts), "num_answers": len(requests),
        "prompts": [{"id": p["id"], "category": p["category"], "turns": 1} for p in prompts],
        "methods": entries,
        "per_category_tau": {cat: {m: entries[m]["per_category"].get(cat, {}).get("tau") for m in entries}
                             for cat in categories},
        "best_k": None, "best_k_method": None,  # best k needs our engine's forward costs
        "vllm": section, "answers": rows,
    }
    report["recommendation"] = recommend(report)
    return report


def markdown(report: dict) -> str:
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    ci = lambda v: "-" if not v else f"[{v[0]:.2f}, {v[1]:.2f}]"  # noqa: E731
    level = f"{report['settings']['bootstrap']['level']:.0%}"
    lines = [f"# Evaluate: {report['target']} on {report['dataset']}, in vLLM alone", "",
             f"Baseline: **{report['baseline']}** (our engine does not run: {report['engine']}). "
             f"{report['num_prompts']} prompts, {report['turns']}.", "",
             f"| method | tau | tau {level} CI | tokens/s | speedup vs {report['baseline']} | speedup {level} CI "
             f"| identical to {report['baseline']} |", "|---|---:|---|---:|---:|---|:---:|"]
    for name, m in report["methods"].items():
        same = {True: "yes", False: f"NO ({m['identical_answers']})", None: "n/a"}[m["identical_to_plain"]]
        lines.append(f"| {name} | {f(m['tau'])} | {ci(m['tau_ci'])} | {f(m['tokens_per_s'], '.1f')} | "
                     f"{f(m['speedup'])}x | {ci(m['speedup_ci'])} | {same} |")
    rec = report["recommendation"]
    lines += ["", "## Recommendation", "", f"Baseline {rec['baseline']}. Deploy **{rec['deploy']}**: "
              + "; ".join(rec["reasons"]) + ".", *(f"- {line}" for line in rec["alternatives"])]
    if report["skipped"]:
        lines += ["", f"Skipped {report['skipped']['prompt_too_long']} prompt(s) longer than the target's context."]
    return "\n".join(lines) + "\n" + vllm_report.markdown(report["vllm"], report["settings"]["num_draft_tokens"])
