"""The EAGLE-3 demo's learning curve: held-out acceptance against training tokens and CPU minutes.

    python -m benchmarks.training.bench_learning_curve features     # the demo's rows' target features, once
    python -m benchmarks.training.bench_learning_curve train NAME   # one recipe of RECIPES, its epochs (~6 min each)
    python -m benchmarks.training.bench_learning_curve evaluate     # decoded tau of every saved drafter, one run
    python -m benchmarks.training.bench_learning_curve onpolicy     # teacher-forced tau on the target's own answers
    python -m benchmarks.training.bench_learning_curve record --sampling-min M   # JSON, plot and docs section

The demo recipe's training rows (its sampled conversations and source ones), their target features
computed once under bf16 autocast (the stage's default) and kept under runs/bench_learning_curve/.
Each recipe trains its epochs over them through `bench_eagle3_options.run` (the stage's loss,
optimiser and schedule, over all of the run's epochs), scored teacher-forced on 40 held-out
conversations at four points an epoch and saved after each epoch; one evaluate then decodes the saved
drafters on held-out prompts: MT-Bench first turns that the demo does not evaluate. The one-epoch
variants (STUDY) change one thing of the new recipe each: the loss, the schedule's floor, the norms.

CPU minutes are what the demo's online train stage would spend on those tokens on this machine:
tokens over the stage's measured tokens/s for that recipe (benchmarks/results/demo_training.json),
plus the demo's sampling minutes (the same for every recipe), so the axis counts what a user pays.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from benchmarks.common import (DOC, asks_help, choose, compose_config, fail, load_results, run, run_cli, run_file,
                               update_doc_section, with_ci, write_results)
from specforge_lite.drafters.registry import drafter_module
from specforge_lite.records import goals as issue_goals

OUT = Path("runs/bench_learning_curve")  # relative: run from the repository's root, like every benchmark
SAMPLES = Path("runs/smollm2/samples")  # the demo recipe's samples_dir
# each recipe as bench_eagle3_options options, its row of demo_training.json (its stage's speed), its
# epochs (the schedule spans them all) and the epochs decoded: today's recipe at the demo's budget, the
# new one over two and four times it, and the new one at the demo's budget with one thing changed
# (the loss, the schedule's floor, the norms), which the study judges against "new1"
NEW = {"lr": "3e-3", "bs": "1", "mp": "bf16", "opt": "muon"}
RECIPES = {
    "before": ({"lr": "1e-3", "bs": "1", "mp": "bf16", "opt": "adamw"}, "before", 1, (1,)),
    "new": (NEW, "bf16 target + Muon", 2, (1, 2)),
    "new4": (NEW, "bf16 target + Muon", 4, (2, 4)),
    "new1": (NEW, "bf16 target + Muon", 1, (1,)),
    "reverse_kl": ({**NEW, "cfg": "drafter.loss=reverse_kl"}, "bf16 target + Muon", 1, (1,)),
    "jsd": ({**NEW, "cfg": "drafter.loss=jsd"}, "bf16 target + Muon", 1, (1,)),
    "constant_lr": ({**NEW, "cfg": "train.min_lr_ratio=1.0"}, "bf16 target + Muon", 1, (1,)),
    "norms31": ({**NEW, "cfg": "drafter.fc_norm=true,drafter.norm_output=true"}, "bf16 target + Muon", 1, (1,)),
}
STUDY = ("new1", "reverse_kl", "jsd", "constant_lr", "norms31")  # one epoch each: losses, schedule, norms
HELD_PROMPTS, NEW_TOKENS = 24, 64


def demo_config():
    return compose_config(["+recipe=eagle_smollm2", "stage=train", f"samples_dir={SAMPLES}"])


def features() -> None:
    import torch

    from benchmarks.training.bench_eagle3_options import features as build

    build(OUT, demo_config(), compute=torch.bfloat16)


def train(name: str) -> None:
    from benchmarks.training.bench_eagle3_options import train_variant

    options, _, epochs, _ = RECIPES[choose(name, RECIPES, "recipe")]
    train_variant(name, {**options, "epochs": str(epochs), "points": str(4 * epochs), "save": "1"}, OUT)


def variants() -> dict:
    return {name: json.loads((OUT / "variants" / f"{name}.json").read_text()) for name in RECIPES
            if (OUT / "variants" / f"{name}.json").exists()}


def heldout_prompts() -> Path:
    """MT-Bench first turns the demo does not evaluate (it takes `eval.max_prompts` round robin)."""
    from specforge_lite.data.eval_prompts import read_eval_prompts, select_prompts

    demo = compose_config(["+recipe=eagle_smollm2", "stage=evaluate"])
    prompts = read_eval_prompts("builtin:mt_bench")
    used = {p["id"] for p in select_prompts(prompts, demo.eval.max_prompts)}
    path = OUT / "mtbench_not_in_demo.jsonl"
    path.write_text("".join(json.dumps({"id": p["id"], "category": p["category"], "turns": p["turns"][:1]}) + "\n"
                            for p in prompts if p["id"] not in used))
    return path


def decoded_drafters() -> list[tuple[str, str]]:
    """(method name, drafter folder) of every saved drafter the evaluate decodes."""
    return [(f"{name}-e{i + 1}", p["drafter"]) for name, v in variants().items()
            for i, p in enumerate(x for x in v["curve"] if "drafter" in x) if i + 1 in RECIPES[name][3]]


def evaluate() -> None:
    drafters = [f"{name}:{folder}" for name, folder in decoded_drafters()]
    run_dir = OUT / "eval_run"
    if not drafters:
        fail(f"no saved drafter under {OUT}; `python -m {__spec__.name} train NAME` makes one")
    run_cli(["evaluate", "+recipe=eagle_smollm2", f"run_dir={run_dir}", f"samples_dir={SAMPLES}",
             f"eval.dataset={heldout_prompts()}", f"eval.max_prompts={HELD_PROMPTS}", f"eval.max_new_tokens={NEW_TOKENS}",
             "eval.methods=[plain,ngram]", f"eval.extra_drafters=[{','.join(drafters)}]",
             f"eval.best_k_method={drafters[-1].split(':')[0]}"], "evaluate",
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, quiet=False)


def onpolicy() -> None:
    """Teacher-forced tau of every decoded drafter on the target's own greedy answers to the held-out
    prompts (the text decoding verifies), to set beside the same score on the 40 held-out training-like
    conversations: where the two differ, the gap is the text's, not the decoder's."""
    import torch

    from benchmarks.training.bench_eagle3_options import teacher_forced
    from specforge_lite.data.chat import prompt_ids
    from specforge_lite.data.eval_prompts import read_eval_prompts, select_prompts
    from specforge_lite.targets.loading import load_target

    cfg = demo_config()
    target, tokenizer = load_target(cfg.target)
    rows = []
    for prompt in select_prompts(read_eval_prompts(str(OUT / "mtbench_not_in_demo.jsonl")), HELD_PROMPTS):
        ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt["turns"][0]}])
        with torch.no_grad():  # greedy in fp32: the answers plain decoding gave in the evaluate
            answer = target.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
        rows.append({"input_ids": ids + answer.tolist(), "loss_mask": [0] * len(ids) + [1] * len(answer)})
    scores = {}
    eagle3 = drafter_module("eagle3")
    for name, folder in decoded_drafters():
        scores[name] = teacher_forced(eagle3.load(Path(folder), target), target, tokenizer, rows, cfg)
        print(name, scores[name], flush=True)
    (OUT / "onpolicy.json").write_text(json.dumps(scores))


def minutes(tokens: int, rate: float, sampling_min: float) -> float:
    return sampling_min + tokens / rate / 60


def needed_tau(method: dict, plain: dict, speedup: float) -> float:
    """The tau at which this drafter, at its measured costs per decoding step (verify forward,
    drafting, overhead), reaches `speedup` over plain decoding per answer as this evaluate measures
    it: an answer of N tokens costs plain P + (N - 1) * its step, the drafter P + (N - 1) / tau *
    its step, P (the prefill and the rest outside the steps) read off plain's measured wall time."""
    n = plain["num_tokens"] / plain["num_answers"]
    plain_answer_ms = 1e3 * plain["wall_s"] / plain["num_answers"]
    outside = plain_answer_ms - (n - 1) * (plain["target_forward_ms"] + plain["overhead_ms_per_step"])
    step_ms = method["target_forward_ms"] + method["draft_ms_per_step"] + method["overhead_ms_per_step"]
    budget = plain_answer_ms / speedup - outside
    return (n - 1) * step_ms / budget if budget > 0 else math.inf


def budget_points(curves: dict) -> list[dict]:
    """The new recipe at one, two and four times the demo's budget, each the last epoch of a run whose
    schedule ends there (new1, new, new4): what a user setting train.epochs to 1, 2 or 4 gets."""
    return [c["epochs"][-1] for name in ("new1", "new", "new4") if (c := curves.get(name)) and c["epochs"]
            and c["epochs"][-1]["epoch"] == RECIPES[name][2]]


def record(sampling_min: float) -> None:
    """sampling_min: the demo's sampling minutes as its log reported them (the same for every recipe)."""
    speeds = load_results("demo_training", "python -m benchmarks.training.bench_demo_training")["results"]
    report = run_file(OUT / "eval_run", "eval/report.json", f"python -m {__spec__.name} evaluate")
    methods = report["methods"]
    scored = OUT / "onpolicy.json"
    onpolicy_tau = json.loads(scored.read_text()) if scored.exists() else {}
    curves = {}
    for name, v in variants().items():
        rate = speeds[RECIPES[name][1]]["tokens_per_s"]
        points = [{**p, "cpu_min": minutes(p["tokens"], rate, sampling_min)} for p in v["curve"]]
        epochs = [p for p in points if "drafter" in p]
        for i, p in enumerate(epochs):
            p["epoch"] = i + 1
            m = methods.get(f"{name}-e{i + 1}")
            if m:
                p.update(decoded_tau=m["tau"], decoded_tau_ci=m["tau_ci"], speedup=m["speedup"],
                         speedup_ci=m["speedup_ci"], per_position=m["per_position_acceptance"])
                if f"{name}-e{i + 1}" in onpolicy_tau:
                    p["onpolicy_tau"] = onpolicy_tau[f"{name}-e{i + 1}"]["tau"]
        epochs = [p for p in epochs if "decoded_tau" in p]
        curves[name] = {"options": v["options"], "stage_tokens_per_s": rate, "points": points, "epochs": epochs,
                        "train_s": v["curve"][-1]["train_s"]}
    # the tau needed, at the costs of the longest-trained new drafter (every new drafter has the same shapes)
    last = next(m for m in ("new4-e4", "new-e2", "new1-e1") if m in methods)
    wanted = issue_goals.goals_of("learning_curve")["speedup_over_plain"]["at_least"]  # benchmarks/goals.yaml
    plain_key = f"plain_x{wanted:g}"
    goal = {plain_key: needed_tau(methods[last], methods["plain"], wanted),
            "ngram": needed_tau(methods[last], methods["plain"], methods["ngram"]["speedup"])}
    frontier = budget_points(curves)
    projection = project(frontier, goal[plain_key]) if len(frontier) >= 2 else None
    if projection:
        projection["ngram_cpu_min"] = project(frontier, goal["ngram"])["cpu_min"]
    study = {name: curves[name] for name in STUDY if name in curves and curves[name]["epochs"]}
    command = ("python -m benchmarks.training.bench_learning_curve features; ... train NAME (for NAME in "
               f"{' '.join(RECIPES)}); ... evaluate; {'... onpolicy; ' if onpolicy_tau else ''}"
               f"... record --sampling-min {sampling_min}")
    write_results("learning_curve", {"command": command, "sampling_min": sampling_min,
                                     "heldout": {"prompts": HELD_PROMPTS, "new_tokens": NEW_TOKENS,
                                                 "set": "MT-Bench first turns not in the demo's 24"},
                                     "ngram": {k: methods["ngram"][k] for k in ("tau", "tau_ci", "speedup",
                                                                               "speedup_ci")},
                                     "tau_needed": goal, "budgets": frontier, "projection": projection,
                                     "study": list(study), "curves": curves})
    image = plot({k: c for k, c in curves.items() if k not in STUDY or k == "new1"}, goal[plain_key], wanted)

    def decoded(p: dict) -> str:
        return ((f"{p['onpolicy_tau']:.2f} | " if onpolicy_tau else "")
                + f"{with_ci(p['decoded_tau'], p['decoded_tau_ci'])} | {with_ci(p['speedup'], p['speedup_ci'], suffix='x')}")

    rows = [f"| {name} | {RECIPES[name][2]} | {p['epoch']} | {p['tokens']} | {p['cpu_min']:.1f} | {p['tau']:.3f} | "
            f"{decoded(p)} |" for name, c in curves.items() if name not in STUDY or name == "new1"
            for p in c["epochs"]]
    base = study.get("new1")
    study_rows = [f"| {name} | `{RECIPES[name][0].get('cfg', '(the new recipe)')}` | {c['train_s'] / 60:.1f} | "
                  f"{c['epochs'][-1]['tau']:.3f} | {decoded(c['epochs'][-1])} | "
                  f"{' / '.join(f'{a:.2f}' for a in c['epochs'][-1]['per_position'])} |"
                  for name, c in sorted(study.items(), key=lambda kv: -kv[1]["epochs"][-1]["decoded_tau"])]
    best = max(study, key=lambda k: study[k]["epochs"][-1]["decoded_tau"]) if study else None
    verdict = ""
    if base and best:
        b, w = base["epochs"][-1], study[best]["epochs"][-1]
        apart = w["decoded_tau_ci"][0] > b["decoded_tau_ci"][1]
        verdict = (f"Highest decoded tau: **{best}** ({w['decoded_tau']:.2f} against new1's {b['decoded_tau']:.2f}); "
                   + ("its interval clears new1's, so it is worth a default." if best != "new1" and apart else
                      "no variant's interval clears new1's, so the recipe keeps forward KL, the cosine floor and "
                      "the EAGLE-3 norms." if best != "new1" else "new1 itself: the recipe's defaults stand."))
    onpolicy_head, onpolicy_rule = ("teacher-forced tau on the target's answers | ", "---:|") if onpolicy_tau else ("", "")
    ng = methods["ngram"]
    budget_text = ", ".join(f"{p['tokens'] // 1000}k tokens ({p['cpu_min']:.0f} CPU min) {p['decoded_tau']:.2f}"
                            for p in frontier)
    onpolicy_text = ("; on the target's answers: the same score on the target's own greedy answers to the "
                     "decoded prompts (`... onpolicy`), the text decoding verifies") if onpolicy_tau else ""
    decoded_points = [p for c in curves.values() for p in c["epochs"] if "onpolicy_tau" in p]
    gap = (f" Teacher-forced on the target's own answers, every drafter scores within "
           f"{max(abs(p['onpolicy_tau'] - p['decoded_tau']) for p in decoded_points):.2f} of its decoded tau, while "
           f"on text like the training rows the budget points rise from {frontier[0]['tau']:.2f} to "
           f"{frontier[-1]['tau']:.2f}: decoding counts what the drafter learnt, and what it learns is the "
           f"training text more than the target's answers to other prompts." if decoded_points and frontier else "")
    where = (f"Along these budget points (tau against log CPU minutes, least squares) decoded tau gains "
             f"{projection['slope_per_log_min'] * math.log(2):.3f} per doubling of the CPU minutes; at that rate "
             f"n-gram's speed (tau {goal['ngram']:.2f}) lies {math.log2(projection['ngram_cpu_min'] / frontier[-1]['cpu_min']):.1f} "
             f"doublings beyond the four-fold budget (about {projection['ngram_cpu_min'] / 60:,.0f} CPU hours) and "
             f"{wanted:g}x plain (tau {goal[plain_key]:.2f}) {math.log2(projection['cpu_min'] / frontier[-1]['cpu_min']):.1f}: "
             f"extrapolations beyond the measured budgets, not measurements. More epochs of this recipe "
             f"are not the way to win here." if projection else
             "Fewer than two decoded budget points, or tau not rising with minutes: no projection.")
    update_doc_section("learning_curve", f"""## EAGLE-3 learning curve: the demo's recipe before and after issue 27

Commands: `{command}` (`python -m benchmarks.training.bench_learning_curve`, each step in turn). The demo's
training rows (eagle_smollm2's sampled and source conversations), target features cached once, one sequence
per step. `before` is the recipe before issue 27 (AdamW, lr 1e-3); `new`, `new4` and `new1` are today's
(Muon, lr 3e-3) over 2, 4 and 1 epochs; the schedule spans all of a run's epochs, so epoch 1 of a longer
run is not the one-epoch recipe.
Teacher-forced tau: 40 held-out conversations like the training rows{onpolicy_text}.
Decoded tau: {HELD_PROMPTS} MT-Bench first turns the demo does not evaluate, {NEW_TOKENS} new tokens,
k = 3, our compiled engine, every drafter in one evaluate (95% intervals over prompts).
CPU minutes: sampling ({sampling_min:.1f} min) plus the tokens at the demo train stage's measured
speed for that recipe ("Demo training step"): one epoch is the demo's budget.

| recipe | run's epochs | epoch | tokens | CPU min | teacher-forced tau | {onpolicy_head}decoded tau | speedup vs plain |
|---|---:|---:|---:|---:|---:|{onpolicy_rule}---:|---:|
{chr(10).join(rows)}

n-gram lookup in the same evaluate: tau {ng['tau']:.2f}, {with_ci(ng['speedup'], ng['speedup_ci'], suffix='x')}.
With the drafting and verification costs this
evaluate measured, a drafter needs tau {goal[plain_key]:.2f} for {wanted:g}x plain and {goal['ngram']:.2f} to
match n-gram's speed. Today's recipe run to its end at one, two and four times the demo's budget
(measured): {budget_text}. {where}{gap}

![learning curve]({image})

### Losses, schedule and norms at the demo's budget

The new recipe for one epoch (`new1`) with one thing changed (`drafter.loss`, a constant learning rate
after warm-up in place of the cosine to 10%, EAGLE 3.1's `fc_norm` and `norm_output`), same rows, order
and seed; decoded in the same evaluate as above. Equal CPU minutes: every variant trains the same tokens
(its training minutes, measured in this benchmark, are beside it).

| variant | change | training min | teacher-forced tau | {onpolicy_head}decoded tau | speedup vs plain | acceptance a1 / a2 / a3 |
|---|---|---:|---:|{onpolicy_rule}---:|---:|---|
{chr(10).join(study_rows)}

{verdict}
""")


def project(epochs: list[dict], tau: float) -> dict | None:
    """CPU minutes at which a least-squares line of decoded tau against log minutes reaches `tau`."""
    xs, ys = [math.log(p["cpu_min"]) for p in epochs], [p["decoded_tau"] for p in epochs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    if slope <= 0:
        return None
    return {"tau": tau, "cpu_min": math.exp(mx + (tau - my) / slope), "slope_per_log_min": slope,
            "intercept": my - slope * mx}


def plot(curves: dict, tau_wanted: float, speedup_wanted: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, c in curves.items():
        pts = c["points"]
        axes[0].plot([p["tokens"] / 1e3 for p in pts], [p["tau"] for p in pts], marker=".", label=name)
        axes[1].plot([p["cpu_min"] for p in pts], [p["tau"] for p in pts], marker=".", label=name)
        ep = c["epochs"]
        axes[2].errorbar([p["cpu_min"] for p in ep], [p["decoded_tau"] for p in ep],
                         yerr=[[p["decoded_tau"] - p["decoded_tau_ci"][0] for p in ep],
                               [p["decoded_tau_ci"][1] - p["decoded_tau"] for p in ep]], marker="o", capsize=3,
                         label=name)
    axes[2].axhline(tau_wanted, ls="--", c="grey", label=f"tau for {speedup_wanted:g}x plain")
    axes[0].set(xlabel="training tokens (thousands)", ylabel="teacher-forced tau", title="held-out, per token")
    axes[1].set(xlabel="CPU minutes (sampling + training)", ylabel="teacher-forced tau", title="held-out, per minute")
    axes[2].set(xlabel="CPU minutes (sampling + training)", ylabel="decoded tau (k = 3)",
                title="decoded, MT-Bench not in the demo")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = DOC.parent / "img" / "learning_curve_eagle3.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    return os.path.relpath(out, DOC.parent)


def main() -> None:
    if asks_help(sys.argv[1:], __doc__):
        return
    verbs = {"features": features, "evaluate": evaluate, "onpolicy": onpolicy}
    step = choose(sys.argv[1] if len(sys.argv) > 1 else None, [*verbs, "train", "record"], "step")
    if step == "train" and len(sys.argv) == 3:
        train(sys.argv[2])
    elif step == "record" and len(sys.argv) == 4 and sys.argv[2] == "--sampling-min":
        record(float(sys.argv[3]))
    elif step in verbs and len(sys.argv) == 2:
        verbs[step]()
    else:
        fail(f"usage: python -m {__spec__.name} features | train NAME | evaluate | onpolicy | record --sampling-min M")


if __name__ == "__main__":
    run(main)
