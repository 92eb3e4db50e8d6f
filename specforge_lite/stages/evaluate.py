"""The `evaluate` stage: acceptance length and speedup of each decoder, same run.

Reads an eval prompt set (MT-Bench, the held-out conversations of the training
source, or a prompts JSONL), runs every method of `eval.methods` on every prompt
(methods interleaved per prompt, so a noisy machine hurts them alike), with batch 1,
after warm-up, and writes `run_dir/eval/`:

- `report.json`: per method tau, tokens/s, speedup against our plain loop, 95%
  bootstrap intervals of tau and speedup with the prompts and tokens behind them,
  per-position acceptance, time shares, `identical_to_plain` (greedy), per-category
  numbers, the prompt subset used, and `best_k` (the export stage reads it);
- `report.md`: the same at a glance; PNG plots; `config.yaml` + `versions.json` (all in place at once).
Multi-turn prompts: turn t > 1 follows the target's own plain answer to turn t - 1 (the same for every method).

The serving engines (`serving/engines.py`: vLLM, llama.cpp) decode the same requests after ours, each in its own
report section. With an engine's methods only (`drafters.methods.engine_needed` false) the target's weights never
enter this process: the engine measures against its own plain decoding, first turns only. target.path is resolved
once, here, and handed to every load and engine.
"""

from __future__ import annotations

import hashlib
import logging
import statistics

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from specforge_lite import SpecforgeError
from specforge_lite.run_folders import atomic_write_json, atomic_write_text, replaced_as_one, stage_dir, write_provenance
from specforge_lite.data.chat import prompt_ids, require_chat_template
from specforge_lite.data.eval_prompts import (cache_capacity, conversation, fitting_prompts, load_prompts,
                                             select_prompts)
from specforge_lite.measurement import checks, identity
from specforge_lite.decoding.hybrid import HybridDrafter, clear_hybrid_sources
from specforge_lite.runtime.dtype_choice import chosen_dtype
from specforge_lite.runtime.drift import drifted
from specforge_lite.measurement.metrics import cost_curve_note, measure_forward_costs, our_conventions
from specforge_lite.measurement.report import k_text, render_markdown, write_plots
from specforge_lite.measurement.recommend import recommend
from specforge_lite.decoding.verify import SamplingParams
from specforge_lite.config.draft_tokens import widest_k
from specforge_lite.drafters.methods import PLAIN, engine_needed, run_order, tree_base
from specforge_lite.drafters.registry import DRAFTERS, hidden_layers_of
from specforge_lite.stages.evaluate_decoders import build_decoders, trained_drafters
from specforge_lite.stages.evaluate_entries import (at_temperature, build_report, our_entries, temperature_markdown,
                                                    temperature_summary, temperatures)
from specforge_lite.targets.accounting import record_no_target
from specforge_lite.serving.engines import ENGINES, Engine, ServedTarget, alone_markdown, alone_measured, stop_ids
from specforge_lite.serving.vllm.load_report import write_plot as write_load_plot
from specforge_lite.targets.loading import (eos_token_ids, load_target, load_target_config, load_tokenizer,
                                           resolve_dtype, resolve_target_path)

log = logging.getLogger(__name__)


def _seed(base: int, *parts) -> int:
    digest = hashlib.sha256(":".join(map(str, (base, *parts))).encode()).digest()
    return int.from_bytes(digest[:6], "big")


# --------------------------------------------------------------------------- stage

def run(cfg: DictConfig) -> None:
    ecfg = cfg.eval
    temps = temperatures(ecfg)
    out, report, results, lead = measure(at_temperature(cfg, temps[0]))
    failures = [line for engine in results for line in engine.failures(report[engine.name], out)]
    if len(temps) > 1:  # each further temperature measured whole, its figures beside the first's
        report["by_temperature"] = {str(temps[0]): temperature_summary(report)}
        for temperature in temps[1:]:
            _, other, other_results, _ = measure(at_temperature(cfg, temperature))
            report["by_temperature"][str(temperature)] = temperature_summary(other)
            failures += [f"T={temperature}: {line}" for engine in other_results
                         for line in engine.failures(other[engine.name], out)]
    ours = engine_needed(ecfg)
    with replaced_as_one(out, "evaluate") as new:
        if ecfg.plots and ours:  # the plots draw our engine's per-position acceptance and forward costs
            report["plots"] = write_plots(report, new)
        if ecfg.plots and (load := (report.get("vllm") or {}).get("load")):  # speedup against concurrency
            report.setdefault("plots", []).append(write_load_plot(load, new))
        atomic_write_json(new / "report.json", report)
        markdown = render_markdown(report) if ours else alone_markdown(report, lead)
        atomic_write_text(new / "report.md", markdown + temperature_markdown(report)
                          + "".join(e.markdown(report[e.name], cfg) for e in results))
        write_provenance(new, cfg)
    baseline = report.get("baseline", PLAIN)
    for name, entry in report["methods"].items():
        log.info("%-17s tau %.2f  %.2f tokens/s  speedup %.2fx vs %s%s", name, entry["tau"] or 0,
                 entry["tokens_per_s"], entry["speedup"], baseline,
                 identity.log_suffix(entry))
    rec = report["recommendation"]
    log.info("recommendation (baseline %s): deploy %s (%s)%s", rec["baseline"], rec["deploy"],
             "; ".join(rec["reasons"]), "".join(f"\n  - {line}" for line in rec["alternatives"]))
    for name, entry in report["methods"].items():
        if entry.get("tree") and entry["tree"]["best_tree"]["best"]:
            best = entry["tree"]["best_tree"]["best"]
            log.info("%-17s %.1f nodes verified per step; best tree (estimated): depth %d, branch %d, %d nodes, "
                     "%.2fx", name, entry["tree"]["nodes_per_step"] or 0, best["depth"], best["branch"],
                     best["nodes"], best["expected_speedup"])
    log.info("best k = %s (%s); report in %s", report["best_k"], report["best_k_method"], out / "report.md")
    for engine in results:
        for name, entry in report[engine.name]["methods"].items():
            log.info("%-17s tau %s  %.2f tokens/s (%s)", name, "-" if entry["tau"] is None else f"{entry['tau']:.2f}",
                     entry["tokens_per_s"] or 0, engine.label)
    if failures:
        raise SpecforgeError("; ".join(failures))


def measure(cfg: DictConfig) -> tuple:
    """Every method of eval.methods at one temperature: (out, the report, the engines' results,
    the lead engine where ours does not run, else None). Nothing is written here."""
    ecfg = cfg.eval
    ours = engine_needed(ecfg)  # else every method is a serving engine's, and no target weights load here
    methods = run_order(ecfg)
    served = {engine: engine.methods(methods) for engine in ENGINES}  # run after ours (serving/engines.py)
    if not ours:  # an engine alone measures against its own plain decoding, added when missing
        served = {engine: list(dict.fromkeys([engine.plain, *names])) for engine, names in served.items() if names}
    served = {engine: names for engine, names in served.items() if names}
    methods = [m for m in methods if ours and not any(m in names for names in served.values())]
    prompts = select_prompts(load_prompts(cfg), ecfg.max_prompts)
    path = resolve_target_path(cfg.target.path)  # the stage's one resolution: every load and engine reads it
    if ours:
        out, report, target, requests, plain_tokens = measure_ours(cfg, methods, prompts, path)
    else:
        lead = next(iter(served))
        out, target, requests, prompts, notes = prepare_alone(cfg, lead, prompts, path)
        plain_tokens = None
    results = {engine: engine.run(cfg, names, requests, target, out) for engine, names in served.items()}
    if not ours:  # the lead engine's own table, against its plain decoding
        rows, entries, conventions, fields = alone_measured(cfg, lead, results[lead], prompts, requests, out)
        report = build_report(cfg, prompts, rows, entries, conventions, **fields, **notes)
    report["recommendation"] = recommend(report, {n: m.SERVING_NOTE for n, m in DRAFTERS.items() if m.SERVING_NOTE})
    for engine, result in results.items():
        report[engine.name] = engine.report_section(result, report, plain_tokens, cfg)
    return out, report, results, lead if not ours else None


def measure_ours(cfg: DictConfig, methods: list[str], prompts: list[dict], path: str) -> tuple:
    """Our engine's `methods` on every prompt and turn, interleaved: (out, report, the target
    as the serving engines read it, every request's prompt ids, our plain answers' tokens)."""
    ecfg = cfg.eval
    sampling = SamplingParams(ecfg.temperature, ecfg.top_p)
    model, tokenizer = load_target(cfg.target, path=path)
    widest = max([widest_k(ecfg)] + [ecfg.tree.nodes for m in methods if tree_base(m)])  # best tree's too
    require_chat_template(tokenizer)
    eos_ids = eos_token_ids(model, tokenizer)
    prompts, too_long = fitting_prompts(tokenizer, prompts, ecfg, model.config)
    capacity = cache_capacity(tokenizer, prompts, ecfg, model.config)
    # the dtypes timed on the package the run compiles: the hidden layers its drafters read included
    trained = trained_drafters(cfg, methods, model)
    layers = sorted({layer for kind, module in trained.values() for layer in hidden_layers_of(kind, module)})
    model, dtype_choice = chosen_dtype(cfg.target, model, [1, widest + 1], ecfg.engine, capacity, widest_k(ecfg) + 1,
                                       layers)
    decoders, drafters, target = build_decoders(cfg, methods, model, tokenizer, eos_ids, sampling, capacity, trained)
    out = stage_dir(cfg, "evaluate")  # once every input has loaded
    log.info("evaluating %s on %d prompts of %s (%s, %s)", ", ".join(methods), len(prompts), ecfg.dataset,
             k_text(ecfg), "greedy" if sampling.greedy else f"T={sampling.temperature}")

    # 1. a target forward's cost over 1..k+1 tokens (best k), and on to eval.cost_widths where the cache has
    # room, after a context of a typical prompt and half an answer: the cost model the hybrids start from
    context_len = int(statistics.median(len(prompt_ids(tokenizer, conversation(p, [], 0))) for p in prompts)
                      + ecfg.max_new_tokens // 2)
    room = (target.engine.capacity if target.engine else model.config.max_position_embeddings) - context_len
    top = max(widest + 1, min(ecfg.cost_widths, room))
    costs = measure_forward_costs(model, context_len, top, ecfg.cost_repeats, runner=target.runner())
    for drafter in drafters.values():
        if isinstance(drafter, HybridDrafter):
            drafter.start_costs_from(costs)

    # 2. warm-up: every method, untimed, on the first prompt; a compiled drafter proposing otherwise there
    first, warm = prompt_ids(tokenizer, conversation(prompts[0], [], 0)), min(ecfg.warmup_tokens, ecfg.max_new_tokens)
    for _ in range(ecfg.warmup):
        for name in methods:
            decoders[name](first, warm, _seed(cfg.seed, "warmup"))
    checks.compiled_drafting(decoders, drafters, target.info, first, warm, _seed(cfg.seed, "warmup"))
    clear_hybrid_sources(drafters.values())  # a hybrid counts which source drafted in the timed runs only

    # 3. every prompt, every turn, every method (interleaved)
    answers = []  # {"prompt", "turn", "method", "gen", "identical"}
    requests, plain_tokens = [], []  # every prompt and turn, for the serving engines
    for index, prompt in enumerate(tqdm(prompts, desc="evaluate", unit="prompt", dynamic_ncols=True)):
        replies: list[str] = []
        for turn in range(len(prompt["turns"])):
            ids = prompt_ids(tokenizer, conversation(prompt, replies, turn))
            order = methods[index % len(methods):] + methods[:index % len(methods)]  # a drift hits all alike
            ran = {name: decoders[name](ids, ecfg.max_new_tokens, _seed(cfg.seed, prompt["id"], turn, name))
                   for name in order}
            gens = {name: ran[name] for name in methods}
            requests.append(ids)
            plain_tokens.append(gens[PLAIN].tokens)
            for name, gen in gens.items():
                identical = gen.tokens == gens[PLAIN].tokens if sampling.greedy else None
                answers.append(dict(prompt=prompt, turn=turn, method=name, gen=gen, identical=identical, ids=ids))
            plain = [t for t in gens[PLAIN].tokens if t not in eos_ids]
            replies.append(tokenizer.decode(plain, skip_special_tokens=True).strip())

    reference = identity.Fp32Reference(model)  # one float32 copy: the verdicts (rounding/mismatch), the baseline
    identity.judge(model, answers, PLAIN, reference=reference)
    baseline = sampling.greedy and checks.plain_rounding(model, target, decoders[PLAIN], answers, widest_k(ecfg),
                                                         ecfg.max_new_tokens, eos_ids, PLAIN, reference,
                                                         measure=ecfg.rounding_baseline) or None
    reference.release()

    plain_gens = [a["gen"] for a in answers if a["method"] == PLAIN]
    entries, rows, fields = our_entries(cfg, methods, answers, drafters, costs, context_len, model)
    report = build_report(cfg, prompts, rows, entries, our_conventions(ecfg.bootstrap), **fields)
    report["machine_drift"] = drifted([g.target_s / max(g.num_forwards, 1) for g in plain_gens],
                                      "plain decoding's one-token forward")
    report["settings"]["engine"] = {**target.info, "dtype": dtype_choice}
    report["rounding_baseline"] = baseline
    report["skipped"] = {"prompt_too_long": len(too_long), "ids": too_long} if too_long else {}
    if note := cost_curve_note(model.config):  # a cache that cannot be rolled back: its curve stops at t=1
        report["forward_costs"]["note"] = note
    served = ServedTarget(path, model.config, str(model.dtype).removeprefix("torch."), eos_ids, model, tokenizer)
    return out, report, served, requests, plain_tokens


def prepare_alone(cfg: DictConfig, engine: Engine, prompts: list[dict], path: str) -> tuple:
    """Without our engine: the target's config, tokenizer and prompts only, none of its weights
    (recorded for the rehearsal's accounting), the first turns' requests (a later turn follows
    our plain answer to the one before). Returns (out, target, requests, prompts, report notes)."""
    ecfg = cfg.eval
    config = load_target_config(cfg.target, weights=False, path=path)
    record_no_target(config, f"evaluate without our engine (config, tokenizer and prompts; the target in "
                             f"{engine.label})")
    tokenizer = load_tokenizer(cfg.target, path)
    require_chat_template(tokenizer)
    later_turns = sum(len(p["turns"]) - 1 for p in prompts)
    prompts = [{**p, "turns": p["turns"][:1]} for p in prompts]
    prompts, too_long = fitting_prompts(tokenizer, prompts, ecfg, config)
    requests = [prompt_ids(tokenizer, conversation(p, [], 0)) for p in prompts]
    out = stage_dir(cfg, "evaluate")
    log.info("evaluating in %s alone (%s) on %d prompts of %s, first turns only", engine.label, engine.alone(cfg),
             len(prompts), ecfg.dataset)
    # the dtype our engine would have loaded (auto: fp32 on a CPU, bf16 on a GPU), never an engine's
    # own "auto", which reads the checkpoint's and may differ from the target's recorded runs
    dtype = resolve_dtype(cfg.target.dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    target = ServedTarget(path, config, str(dtype).removeprefix("torch."), stop_ids(path, tokenizer), None, tokenizer)
    notes = {"turns": (f"first turns only: {later_turns} later turn(s) left out (a later turn follows the "
                       "target's plain answer, and no plain decodes in our engine here)" if later_turns
                       else "every prompt has one turn"),
             "skipped": {"prompt_too_long": len(too_long), "ids": too_long} if too_long else {}}
    return out, target, requests, prompts, notes


