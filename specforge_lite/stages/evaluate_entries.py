"""The evaluate report's body from our engine's answers: the methods table (`our_entries`: tau,
speedup, intervals, identity, per-category figures, best k, trees, the hybrids' sources) and the
report around it (`build_report`), whichever engine measured the methods."""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from specforge_lite.measurement import identity
from specforge_lite.measurement.choices import best_k_for, drafted_k, tree_fields
from specforge_lite.measurement.metrics import costs_as_decoding_paid, summarise
from specforge_lite.measurement.stats import method_intervals, prompt_totals
from specforge_lite.drafters.methods import PLAIN, own_k_methods, tree_base

log = logging.getLogger(__name__)


def build_report(cfg: DictConfig, prompts: list[dict], rows: list[dict], entries: dict, conventions: dict,
                 **fields) -> dict:
    """The evaluate report, whichever engine measured its `methods` (`entries`, from the answer
    `rows` the report keeps): ours beside the serving engines, or one engine alone; `fields`:
    what that measurement adds (our forward costs and best k, or the engine's baseline)."""
    ecfg = cfg.eval
    categories = list(dict.fromkeys(p["category"] for p in prompts))
    return {
        "target": cfg.target.path, "dataset": ecfg.dataset, "settings": OmegaConf.to_container(ecfg, resolve=True),
        "conventions": conventions, "num_prompts": len(prompts), "num_answers": sum(len(p["turns"]) for p in prompts),
        "prompts": [{"id": p["id"], "category": p["category"], "turns": len(p["turns"])} for p in prompts],
        "methods": entries, "drafters": measured_drafters(cfg, list(entries)),
        "per_category_tau": {cat: {m: entries[m]["per_category"].get(cat, {}).get("tau") for m in entries}
                             for cat in categories},
        "best_k": None, "best_k_method": None,  # best k needs our engine's forward costs
        **fields, "answers": rows,
    }


def measured_drafters(cfg: DictConfig, methods: list[str]) -> dict:
    """{drafter kind: {"path", "weights"}} of the trained drafters the methods measured (chains,
    trees, hybrids and their vLLM twins), by the content digests of their weight files: what
    export checks before it takes this report's k, tree and recommendation for a drafter."""
    from specforge_lite.drafters.methods import drafter_folder, trained_kinds
    from specforge_lite.targets.digest import folder_digests

    folders = {kind: drafter_folder(cfg, kind) for kind in trained_kinds(methods)}
    return {kind: {"path": str(folder), "weights": folder_digests(folder)}
            for kind, folder in folders.items() if folder.is_dir()}


def our_entries(cfg, methods, answers, drafters, costs, context_len, model) -> tuple[dict, list[dict], dict]:
    """Our engine's `methods` table from its answers, the answer rows and the report fields
    our engine adds (its dtype and device, forward costs, best k)."""
    ecfg = cfg.eval
    greedy = ecfg.temperature == 0
    by_method = defaultdict(list)
    by_method_cat = defaultdict(lambda: defaultdict(list))
    for a in answers:
        by_method[a["method"]].append(a)
        by_method_cat[a["method"]][a["prompt"]["category"]].append(a["gen"])
    plain = summarise([a["gen"] for a in by_method[PLAIN]])
    plain_gens = [a["gen"] for a in by_method[PLAIN]]  # mean answer, for best k's per-answer rates
    answer_shape = (statistics.fmean(g.prefill_s for g in plain_gens),
                    statistics.fmean(len(g.tokens) for g in plain_gens))
    plain_cat = {c: summarise(g) for c, g in by_method_cat[PLAIN].items()}
    hf_plain = summarise([a["gen"] for a in by_method["hf_generate"]]) if "hf_generate" in by_method else None
    answer_rows = [{"prompt_id": a["prompt"]["id"], "category": a["prompt"]["category"], "turn": a["turn"] + 1,
                    "method": a["method"], "num_prompt_tokens": a["gen"].num_prompt_tokens,
                    "num_tokens": len(a["gen"].tokens), "num_forwards": a["gen"].num_forwards,
                    "total_s": a["gen"].total_s, "finish": a["gen"].finish, "tau": a["gen"].tau,
                    "tokens_per_s": len(a["gen"].tokens) / a["gen"].total_s, "identical_to_plain": a["identical"],
                    "tokens_digest": identity.tokens_digest(a["gen"].tokens)}
                   for a in answers]
    # intervals from the rows report.json keeps, so that they can be recomputed from the report alone
    boot = ecfg.bootstrap
    intervals = method_intervals(prompt_totals(answer_rows), PLAIN, boot.resamples, boot.seed, boot.level)

    # best k prices a step at what decoding paid a forward in this run, not the isolated timing
    paid, scale = costs_as_decoding_paid(costs, plain["target_forward_ms"])
    entries = {}
    for name in methods:
        rows = by_method[name]
        chain = name in drafters and not tree_base(name)
        entry = summarise([a["gen"] for a in rows], drafted_k(ecfg, name, drafters[name]) if chain else 0)
        if name in own_k_methods(ecfg):
            entry["k"] = drafted_k(ecfg, name, drafters.get(name))
        entry["speedup"] = entry["tokens_per_s"] / plain["tokens_per_s"]
        entry["speedup_vs_hf_generate"] = entry["tokens_per_s"] / hf_plain["tokens_per_s"] if hf_plain else None
        entry.update(intervals[name])  # tau_ci, speedup_ci, num_prompts
        entry.update(identity.entry_fields(rows, greedy))  # identical_to_plain, identity (bf16 verdicts), lossless
        entry["per_category"] = {}
        for cat, gens in by_method_cat[name].items():
            s = summarise(gens)
            entry["per_category"][cat] = {"tau": s["tau"], "tokens_per_s": s["tokens_per_s"],
                                          "speedup": s["tokens_per_s"] / plain_cat[cat]["tokens_per_s"]}
        if hasattr(drafters.get(name), "sources"):  # a hybrid: the steps each source drafted, the tokens kept
            entry["sources"] = drafters[name].sources
        if chain:
            entry["best_k"] = best_k_for(entry, drafters[name], paid, answer_shape, plain)
        elif tree_base(name):
            entry["tree"] = tree_fields(ecfg.tree, *tree_base(name), [a["gen"] for a in rows], entry,
                                         drafters.get(name) or drafters[tree_base(name)[0]], paid, answer_shape, plain)
        entries[name] = entry

    ours = [m for m in methods if m in drafters and not tree_base(m)]
    best_method = ecfg.best_k_method if ecfg.best_k_method in ours else (ours[0] if ours else None)
    if ecfg.best_k_method and best_method != ecfg.best_k_method:  # the recipe's, left out by eval.methods
        log.info("eval.best_k_method=%s is not among this evaluate's chain methods: best k from %s",
                 ecfg.best_k_method, best_method)
    best = entries[best_method]["best_k"]["best_k"] if best_method in ours else None
    fields = {"dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device),
              "torch_threads": torch.get_num_threads(),
              "forward_costs": {"context_len": context_len, "ms_by_num_tokens": {t: 1e3 * s for t, s in costs.items()},
                                "decoding_scale": scale, "ms_as_decoding_paid": {t: 1e3 * s for t, s in paid.items()}},
              "best_k": best, "best_k_method": best_method, **lookup_corpus(ecfg, drafters)}
    return entries, answer_rows, fields


def lookup_corpus(ecfg, drafters: dict) -> dict:
    """`suffix_corpus` where a method drafted by suffix lookup (suffix, its trees, the hybrids): whether
    the samples were asked for and how many tokens of them lookup read (0: none were found, and
    lookup drafted from each request alone)."""
    for drafter in drafters.values():
        lookup = getattr(drafter, "lookup", drafter)
        if hasattr(lookup, "corpus"):
            tokens = lookup.corpus.num_tokens if lookup.corpus is not None else 0
            return {"suffix_corpus": {"samples_asked": bool(ecfg.suffix.samples), "tokens": tokens}}
    return {}


# --------------------------------------------------------------------------- more than one temperature

def temperatures(ecfg) -> list[float]:
    """eval.temperature as a list: one value, or several (each measured whole, the first the report's own)."""
    value = ecfg.temperature
    return [float(t) for t in value] if isinstance(value, (list, tuple, ListConfig)) else [float(value)]


def at_temperature(cfg: DictConfig, temperature: float) -> DictConfig:
    """A copy of `cfg` with eval.temperature the one number `temperature`."""
    copy = cfg.copy()
    with open_dict(copy):
        copy.eval.temperature = float(temperature)
    return copy


def temperature_summary(report: dict) -> dict:
    """One temperature's figures: per method of each engine tau and speedup (with intervals where
    measured), and at load the best k and speedup per load."""
    summary = {"methods": {name: {key: m.get(key) for key in ("tau", "tau_ci", "speedup", "speedup_ci",
                                                                "tokens_per_s", "identical_to_plain")}
                           for name, m in report["methods"].items()},
               "baseline": report.get("baseline", PLAIN)}
    vllm = report.get("vllm") or {}
    if vllm.get("methods"):
        summary["vllm"] = {name: {"tau": m["tau"], "tokens_per_s": m["tokens_per_s"],
                                  "speedup_vs_vllm_plain": m["speedup_vs_vllm_plain"]}
                           for name, m in vllm["methods"].items()}
    if vllm.get("load"):
        summary["vllm_load"] = {name: {level: at_best_k(cell) for level, cell in m["by_load"].items()}
                                for name, m in vllm["load"]["methods"].items() if name != "vllm_plain"}
    return summary


def at_best_k(cell: dict) -> dict:
    """A load cell's best k and its speedup (1.0, no interval, where none paid: vllm_plain serves)."""
    best = (cell.get("by_k") or {}).get(str(cell.get("best_k")))
    if not cell.get("best_k") or best is None:
        return {"best_k": 0, "speedup": 1.0, "speedup_ci": None, "throughput_ratio": 1.0}
    return {"best_k": cell["best_k"], "speedup": best["speedup"], "speedup_ci": best["speedup_ci"],
            "throughput_ratio": best.get("throughput_ratio")}


def temperature_markdown(report: dict) -> str:
    """report.md's table of tau and speedup per temperature ("" with one temperature)."""
    by_t = report.get("by_temperature")
    if not by_t:
        return ""
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    ci = lambda v: "" if not v else f" [{v[0]:.2f}, {v[1]:.2f}]"  # noqa: E731
    temps = list(by_t)
    lines = ["", "## By temperature", "",
             "Each temperature measured whole, the same prompts and seeds; the tables above are at the first.", "",
             "| method | " + " | ".join(f"T={t} tau | T={t} speedup" for t in temps) + " |",
             "|---|" + "---:|---|" * len(temps)]
    for name in by_t[temps[0]]["methods"]:
        cells = [by_t[t]["methods"].get(name, {}) for t in temps]
        lines.append(f"| {name} | " + " | ".join(f"{f(c.get('tau'))}{ci(c.get('tau_ci'))} | "
                                                 f"{f(c.get('speedup'))}x{ci(c.get('speedup_ci'))}" for c in cells) + " |")
    for name in by_t[temps[0]].get("vllm") or {}:
        if name in by_t[temps[0]]["methods"]:
            continue  # an evaluate of vLLM alone: its methods are the table's rows already
        cells = [(by_t[t].get("vllm") or {}).get(name, {}) for t in temps]
        lines.append(f"| {name} (vLLM) | " + " | ".join(f"{f(c.get('tau'))} | {f(c.get('speedup_vs_vllm_plain'))}x"
                                                         for c in cells) + " |")
    for name in by_t[temps[0]].get("vllm_load") or {}:
        for level in by_t[temps[0]]["vllm_load"][name]:
            cells = [(by_t[t].get("vllm_load") or {}).get(name, {}).get(level, {}) for t in temps]
            lines.append(f"| {name} at load {level} (best k) | " + " | ".join(
                f"k={c.get('best_k')} | {f(c.get('speedup'))}x{ci(c.get('speedup_ci'))}" for c in cells) + " |")
    return "\n".join(lines) + "\n"
