"""The recommendation of an evaluation report: which method to deploy and how sure the
measurement lets us be (its Markdown is `report.py`'s)."""

from __future__ import annotations

from specforge_lite.measurement.stats import bootstrap_settings, prompt_totals, speed_ratio_interval


SERVING_NOTES = {
    "untrained_draft": "an untrained draft model: distil it first (make distill)",
    "hf_prompt_lookup": "Hugging Face prompt lookup is ngram drafting; serve it as vLLM's `ngram` method",
    "hf_assisted": "Hugging Face assisted generation with a draft model; serve the draft as vLLM `draft_model`",
    "suffix": "vLLM serves suffix decoding as `method: suffix` (arctic-inference; its corpus: the answers it served)",
    "arctic_suffix": "Arctic Inference's suffix decoding is vLLM's `method: suffix` (its corpus: the answers it served)",
}
HYBRIDS = ("_hybrid", "_hybrid_tree")  # <drafter>_hybrid and its tree (decoding/hybrid.py): our engine's own


def recommend(report: dict, notes: dict[str, str] | None = None) -> dict:
    """Which drafter to deploy, from the measured numbers of one evaluate run.

    `deploy`: the lossless method (identical to plain under greedy decoding, answers that differ
    only by the dtype's rounding included: `lossless`, measurement/identity.py) with the highest
    tokens/s. `alternatives`: when another method is worth preferring, each with the numbers
    behind it: a higher tau (on a GPU, where a draft step costs little next to a big target's
    forward, tau decides), categories where another method is faster, and serving limits.

    Whether the winner is clear: `runner_up` is the next fastest lossless method (HF's plain
    `generate` left out: it is plain decoding too) and `speed_ratio_ci` the paired-bootstrap
    interval over prompts (stats.speed_ratio_interval, the report's bootstrap settings) of
    deploy's tokens/s over runner_up's, recomputed from the report's per-answer rows.
    `clear_winner` is True when that interval lies above 1.0; when it includes 1.0 the reasons
    say there is no clear winner between the two on this prompt set (a paired ratio, not an
    overlap of the two speedup intervals: both methods answered the same prompts, and
    prompt-to-prompt spread common to both cancels in the ratio). `clear_winner` is None when
    the report has no per-answer timings (reports written before intervals existed). Apart
    from that, when the fastest speculative method's `speedup_ci` includes 1.0 the reasons say
    its gain over plain decoding is not clear.
    """
    methods = report["methods"]
    plain = report.get("baseline", "plain")  # vllm_plain in an evaluate without our engine
    lossless = {n: m for n, m in methods.items() if m.get("lossless", m.get("identical_to_plain")) is not False}
    deploy = max(lossless, key=lambda n: lossless[n]["tokens_per_s"])
    best = lossless[deploy]
    # where methods drafted different k (eval.method_draft_tokens), the k to serve it with
    at_k = f" at k = {best['k']}" if best.get("k") and report.get("settings", {}).get("method_draft_tokens") else ""
    reasons = [f"{deploy}{at_k}: highest measured speed, {best['tokens_per_s']:.1f} tokens/s "
               f"({best['speedup']:.2f}x {plain}, tau {best['tau']:.2f})"]
    if deploy == plain:
        reasons.append(f"no drafter beats plain decoding ({plain}) on this machine and prompt set")
    ranked = sorted((n for n in lossless if n not in (deploy, "hf_generate")),
                    key=lambda n: -lossless[n]["tokens_per_s"])
    runner_up = ranked[0] if ranked else None
    speculative = {n: m for n, m in lossless.items() if n not in (plain, "hf_generate")}
    fastest_speculative = max(speculative, key=lambda n: speculative[n]["tokens_per_s"]) if speculative else None
    ratio_ci, num_prompts = _winner_interval(report, deploy, runner_up)
    clear_winner = None if ratio_ci is None else ratio_ci[0] > 1.0
    if ratio_ci is not None:
        reasons.append(_winner_wording(deploy, runner_up, ratio_ci, num_prompts, _level(report)))
    # the fastest speculative method against plain, unless the sentence above already said it
    said_for_plain = clear_winner is False and plain in (deploy, runner_up)
    gain_ci = speculative.get(fastest_speculative, {}).get("speedup_ci")
    if (gain_ci and gain_ci[0] <= 1.0 <= gain_ci[1]
            and not (said_for_plain and fastest_speculative in (deploy, runner_up))):
        reasons.append(f"the gain of {fastest_speculative} over plain decoding is not clear: the "
                       f"{_level(report)} interval of its speedup, {_interval(gain_ci)}, includes 1.00")
    notes = {**SERVING_NOTES, **(notes or {})}
    for name in (n for n in lossless if n.endswith(HYBRIDS)):  # decoding/hybrid.py: our engine's own
        notes[name] = (f"{name} is served by our engine only: vLLM serves suffix decoding (`method: suffix`) and "
                       f"the {name[:name.rindex('_hybrid')]} drafter, each alone")
    alternatives = []
    if speculative:
        top_tau = max(speculative, key=lambda n: speculative[n]["tau"])
        if top_tau != deploy and speculative[top_tau]["tau"] > best["tau"]:
            top, other = speculative[top_tau]["tau"], best["tau"]
            digits = 2 if f"{top:.2f}" != f"{other:.2f}" else 3  # 1.434 vs 1.433, not 1.43 vs 1.43
            alternatives.append(f"{top_tau} has the highest tau ({top:.{digits}f} vs {other:.{digits}f}): prefer it "
                                f"where a target forward costs much more than a draft step (large targets on GPUs)")
    for category in report.get("per_category_tau", {}):
        rates = {n: m["per_category"].get(category, {}).get("speedup") for n, m in lossless.items()}
        rates = {n: r for n, r in rates.items() if r is not None}
        if rates:
            winner = max(rates, key=rates.get)
            if winner != deploy and rates[winner] > rates.get(deploy, 0) * 1.05:
                alternatives.append(f"for {category} prompts {winner} is faster ({rates[winner]:.2f}x vs "
                                    f"{rates.get(deploy, 0):.2f}x plain)")
    tree = best.get("tree")
    if tree:  # a tree method wins: how far its chain is, and where a tree can be served
        chain = lossless.get(tree["chain"])
        alternatives.append(f"{deploy} drafts trees of {tree['chain']}"
                            + (f" (its chain: {chain['speedup']:.2f}x {plain})" if chain else "")
                            + ": vLLM 0.32 and llama.cpp serve chains only; the export README gives the tree as "
                            "vLLM's speculative_token_tree for releases with tree attention")
    if deploy.endswith(HYBRIDS):  # ours only: the fastest method a serving engine runs as measured
        served = next((n for n in ranked if not n.endswith(HYBRIDS) and not lossless[n].get("tree")
                       and n not in ("untrained_draft", plain)), None)
        alternatives.append(notes[deploy] + (f"; the fastest method an engine serves is {served} "
                                             f"({lossless[served]['speedup']:.2f}x {plain})" if served else ""))
    elif deploy in notes:  # the runner-up, and the fastest method without a note of its own where that is another
        plain_served = next((n for n in ranked if n not in notes), None)
        tail = f"; the next fastest is {runner_up} ({lossless[runner_up]['speedup']:.2f}x)" if runner_up else ""
        if plain_served and plain_served != runner_up:
            tail += f", the fastest served as measured {plain_served} ({lossless[plain_served]['speedup']:.2f}x)"
        alternatives.append(notes[deploy] + tail)
    return {"deploy": deploy, "baseline": plain, "reasons": reasons, "alternatives": alternatives,
            "runner_up": runner_up, "speed_ratio_ci": ratio_ci, "clear_winner": clear_winner}


def _level(report: dict) -> str:
    return f"{bootstrap_settings(report.get('settings'))['level']:.0%}"


def _interval(ci: list[float]) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def _winner_interval(report: dict, deploy: str, runner_up: str | None) -> tuple[list[float] | None, int]:
    """(paired-bootstrap interval of deploy's tokens/s over runner_up's, prompts behind it), from
    report["answers"]; (None, 0) without a runner-up or without per-answer forwards and timings."""
    rows = [row for row in report.get("answers", []) if row.get("method") in (deploy, runner_up)]
    if runner_up is None or not rows or any("total_s" not in row or "num_forwards" not in row for row in rows):
        return None, 0
    totals = prompt_totals(rows)
    boot = bootstrap_settings(report.get("settings"))
    return speed_ratio_interval(totals[deploy], totals[runner_up], **boot), totals[deploy].num_prompts


def _winner_wording(deploy: str, runner_up: str, ratio_ci: list[float], num_prompts: int, level: str) -> str:
    """The reason saying whether deploy is clearly faster than runner_up (ratio_ci of their speeds)."""
    interval, behind = _interval(ratio_ci), f"{num_prompts} prompts, paired bootstrap"
    if ratio_ci[0] > 1.0:
        return (f"{deploy} is clearly faster than {runner_up}: the {level} interval of its speed over "
                f"{runner_up}'s is {interval} ({behind})")
    relation = "includes 1.00" if ratio_ci[1] >= 1.0 else "lies below 1.00"  # below: only by bootstrap skew
    if runner_up == "plain":  # the ratio is deploy's speedup: one sentence says both things
        return (f"no clear winner between {deploy} and plain decoding on this prompt set: the gain over plain "
                f"decoding is not clear (the {level} interval of {deploy}'s speedup, {interval}, {relation}; "
                f"{behind})")
    if deploy == "plain":
        return (f"no clear winner between plain decoding and {runner_up} on this prompt set: the gain of "
                f"{runner_up} over plain decoding is not clear (the {level} interval of plain's speed over "
                f"{runner_up}'s, {interval}, {relation}; {behind})")
    return (f"no clear winner between {deploy} and {runner_up} on this prompt set: the {level} interval of "
            f"{deploy}'s speed over {runner_up}'s, {interval}, {relation} ({behind})")
