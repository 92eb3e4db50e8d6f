"""`make rehearse RECIPE=NAME`: a GPU recipe's card, command by command, on CPU ranks.

The commands live in one place, `recipes/NAME/commands.yaml`; the card (`recipes/NAME/README.md`,
between the `commands` markers) is written from it (`python -m specforge_lite.scale.rehearse --cards`)
and the rehearsal runs the same commands, each as typed, with only these settings added:

- a tiny stand-in target of the same family: the recipe's target config (assets/configs) with
  every width scaled down and its layer kinds, attention layout (heads per KV head), rope
  scaling and embedding tying kept, at least one KV head per rank (as the recipe's 8 KV heads
  over its 8 GPUs), random weights, a byte-level tokenizer, fp32 on CPU; the
  aux-layer rule is the drafter's own (`[2, L//2, L-3]` of the stand-in's depth) and the draft
  vocabulary keeps the recipe's fraction of the target vocabulary;
- the card's parallel layout scaled down: `trainer.num_processes=R` (the card's ranks are the
  node's GPUs, found by the stage itself), vLLM's tensor parallelism R;
- the recipe's `rehearsal.overrides` (a few rows, steps and tokens);
- where vLLM is installed (`make vllm`; CI), sampling and a vllm_* evaluate run in vLLM as the
  card says, with tensor parallelism R over CPU workers, and each worker reports what it holds;
  without vLLM (or with `--no-vllm`), sampling with the hf backend and a vllm_* evaluate with
  our engine's twins of its methods (vllm_eagle3 -> eagle3), which hold the whole target:
  such a stage is reported under `rehearsal.pending` instead.

A card command marked `rehearse: false` (installing, downloading the weights, serving) is
printed in the card and skipped here; a `train.dry_run=true` command loads no target.
After every training command the rehearsal reads the per-rank real-token counts the stage
wrote (run_dir/train/metrics.json) and fails when any rank trained on no real token in a step.

Each stage records what every rank holds of the target (`specforge_lite/targets/accounting.py`); the
rehearsal compares each rank's peak of decoder-layer weights with 1/R of them, per command,
and writes `benchmarks/results/rehearse_NAME.json`. A stage listed under `rehearsal.pending`
(not yet sharded) is reported as such instead of failing; any other over-share fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from specforge_lite.targets.accounting import clear, stage_summary
from specforge_lite.drafters.methods import VLLM_OF
from specforge_lite.runtime.machine import cpu_model, machine, source_state
from specforge_lite.stage_table import COMMANDS, runs

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "configs"
RESULTS = REPO / "benchmarks" / "results"
BEGIN, END = "<!-- commands: generated from commands.yaml by python -m specforge_lite.scale.rehearse --cards -->", \
    "<!-- end of commands -->"
STAND_IN_VOCAB = 320  # the byte-level tokenizer's 259 ids, padded as the tiny test target is
STAND_IN_HEAD_DIM = 32  # the smallest head size vLLM's CPU attention kernels take


def load_spec(recipe: str) -> dict:
    path = RECIPES / recipe / "commands.yaml"
    if not path.is_file():
        known = sorted(p.parent.name for p in RECIPES.glob("*/commands.yaml"))
        print(f"error: {path.relative_to(REPO)} not found; recipes with a rehearsal: {', '.join(known) or 'none'}",
              file=sys.stderr)
        raise SystemExit(2)
    return yaml.safe_load(path.read_text())


# --------------------------------------------------------------------------- the card

def card_section(spec: dict) -> str:
    lines = [BEGIN, "", "```bash"]
    for number, command in enumerate(spec["commands"], 1):
        lines.append(f"# {number}. {command['says']}")
        lines.append(command["run"])
    lines += ["```", "", f"Rehearsed on CPU ranks with a tiny stand-in target: `make rehearse RECIPE={spec['recipe']}` "
              f"(the same commands with {spec['rehearsal']['ranks']} ranks for the node's "
              f"{spec['layout']['gpus_per_node']} GPUs; per-rank target weights held, per stage, in "
              f"`benchmarks/results/rehearse_{spec['recipe']}.json`).", *last_verdicts(spec), "", END]
    return "\n".join(lines)


def last_verdicts(spec: dict) -> list[str]:
    """What the recorded rehearsal found, stage by stage (from its results file, no figures)."""
    path = RESULTS / f"rehearse_{spec['recipe']}.json"
    if not path.exists():
        return []
    runs = json.loads(path.read_text()).get("runs", {})
    if str(spec["rehearsal"]["ranks"]) not in runs:
        return []
    within, not_yet = [], []
    run = runs[str(spec["rehearsal"]["ranks"])]
    how = ("Sampling and evaluate ran in vLLM as the card says, with tensor parallelism over the CPU ranks, each "
           "worker reporting what it holds." if run.get("vllm") else
           f"Substituted without vLLM: {run['substituted']}." if run.get("substituted") else None)
    trained = [f"{c['label']} ({', '.join(f'r{r} {n}' for r, n in enumerate(c['real_tokens_per_rank']))} real tokens "
               f"over {c['steps']} steps)" for c in run["commands"] if c.get("real_tokens_per_rank")]
    for command in run["commands"]:
        for stage, acc in command.get("stages", {}).items():
            name = command["label"] if command["label"] == stage else f"{command['label']} ({stage})"
            (within if acc["within_share"] else not_yet).append(
                name if acc["within_share"] else f"{name}: {acc['verdict'].split(': ', 1)[-1]}")
    return ["", *([how] if how else []),
            "Every rank within its share of the target's layer weights: " + (", ".join(within) or "none") + ".",
            *([f"Not yet: {'; '.join(not_yet)}."] if not_yet else []),
            *([f"Every rank trained on real tokens at every step: {'; '.join(trained)}."] if trained else [])]


def write_card(recipe: str) -> bool:
    """Put the commands section into the recipe's card; True when the card changed."""
    spec = load_spec(recipe)
    card = RECIPES / recipe / "README.md"
    text = card.read_text() if card.exists() else f"# {recipe}\n"
    section = card_section(spec)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        new = head + section + rest.split(END, 1)[1]
    else:
        new = text.rstrip("\n") + "\n\n## Commands\n\n" + section + "\n"
    if new != text:
        card.write_text(new)
    return new != text


# --------------------------------------------------------------------------- the stand-in

def scaled_config(name: str, layers: int, ranks: int) -> dict:
    """`assets/configs/NAME.json` scaled down: depth to `layers`, heads of STAND_IN_HEAD_DIM,
    as few KV heads as keep one per rank (and 8 heads at least); the ratios that define the
    family (heads per KV head, MLP width over hidden), rope scaling and tying kept."""
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    group = heads // kv
    new_kv = max(ranks, -(-8 // group))
    new_heads = group * new_kv
    hidden = new_heads * STAND_IN_HEAD_DIM
    scaled = dict(config, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=new_heads,
                  num_key_value_heads=new_kv, head_dim=STAND_IN_HEAD_DIM,
                  intermediate_size=hidden * config["intermediate_size"] // config["hidden_size"],
                  vocab_size=STAND_IN_VOCAB, bos_token_id=257, eos_token_id=258, pad_token_id=258)
    if "num_experts" in config:  # a mixture of experts keeps a router choosing several of several experts
        scaled.update(moe_intermediate_size=hidden * config["moe_intermediate_size"] // config["hidden_size"],
                      num_experts=8, num_experts_per_tok=2)
    if "max_window_layers" in config:
        scaled["max_window_layers"] = layers
    return scaled


def build_model(config: dict, out: Path, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from specforge_lite.targets.loading import byte_level_tokenizer
    from specforge_lite.targets.model_types import config_from_dict

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_from_dict(config))
    model.generation_config.eos_token_id = config["eos_token_id"]
    model.generation_config.pad_token_id = config["pad_token_id"]
    model.save_pretrained(out)
    byte_level_tokenizer().save_pretrained(out)


def build_stand_in(spec: dict, out: Path, ranks: int) -> dict:
    """The stand-in target (and student) under `out`; returns the overrides that name them."""
    stand = spec["stand_in"]
    target = out / "target"
    config = scaled_config(stand["target"], stand["layers"], ranks)
    build_model(config, target, 0)
    settings = {"target.path": str(target), "target.dtype": "float32", "target.device": "cpu"}
    full_vocab = json.loads((CONFIGS / f"{stand['target']}.json").read_text())["vocab_size"]
    if "draft_vocab_size" in stand:  # the same fraction of the vocabulary
        settings["drafter.draft_vocab_size"] = str(round(STAND_IN_VOCAB * stand["draft_vocab_size"] / full_vocab))
    if "student" in stand:
        student = out / "student"
        build_model(scaled_config(stand["student"], stand["student_layers"], ranks), student, 1)
        settings.update({key: str(student) for key in stand["student_keys"]})
    return settings


# --------------------------------------------------------------------------- the rehearsal

def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None or bool(os.environ.get("SPECFORGE_LITE_VLLM_PYTHON")) \
        or (REPO / ".venv-vllm" / "bin" / "python").exists()


def rehearsed_argv(run: str, settings: dict, python: str = sys.executable) -> list[str]:
    """The card's command with the rehearsal's settings in place of the same keys, run by `python`."""
    words = shlex.split(run)
    if words[:3] != ["python", "-m", "specforge_lite"]:
        print(f"error: a card command must start `python -m specforge_lite`: {run}", file=sys.stderr)
        raise SystemExit(2)
    kept = [w for w in words[3:] if w.lstrip("+").split("=", 1)[0] not in settings]
    return [python, "-m", "specforge_lite", *kept, *(f"{k}={v}" for k, v in settings.items())]


def engine_twins(run: str) -> str | None:
    """`eval.methods` of a card command with each vllm_* method replaced by our engine's twin
    (`[vllm_plain,vllm_eagle3]` -> `[plain,eagle3]`), or None when it lists no vllm_* method."""
    for word in shlex.split(run):
        if word.startswith("eval.methods="):
            methods = [m.strip() for m in word.split("=", 1)[1].strip("[]").split(",") if m.strip()]
            if any(m in VLLM_OF for m in methods):
                return "[" + ",".join(dict.fromkeys(VLLM_OF.get(m, m) for m in methods)) + "]"
    return None


def rehearse(recipe: str, ranks: int, work: Path, use_vllm: bool = False, labels: tuple[str, ...] | None = None,
             extra: dict | None = None, python: str = sys.executable) -> dict:
    """The card's commands (those of `labels`, default all) on `ranks` CPU ranks, each run by
    `python`; `extra`: settings added after the rehearsal's own (a test's variation of the card)."""
    spec = load_spec(recipe)
    rehearsal = spec["rehearsal"]
    shutil.rmtree(work / "run", ignore_errors=True)  # a rehearsal starts from nothing: no stage resumes
    settings = build_stand_in(spec, work / "stand_in", ranks)
    settings.update({"trainer.num_processes": str(ranks), "sample.vllm.tensor_parallel_size": str(ranks),
                     "eval.vllm.tensor_parallel_size": str(ranks), "run_dir": str(work / "run")})
    substituted = None
    if not use_vllm:
        settings["sample.backend"] = "hf"
        substituted = ("sample.backend=hf and our engine's twins of the vllm_* evaluate methods (vLLM not used "
                       "here: its workers would hold the target, 1/N each)")
    for item in rehearsal.get("overrides", []):
        key, value = item.split("=", 1)
        settings[key] = value
    settings.update(extra or {})
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "offline"), HF_HUB_OFFLINE="1")
    pending = rehearsal.get("pending", {})
    whole = set(rehearsal.get("whole", []))  # stages the card runs with the whole target per rank (an 8B one)
    def portable(text: str) -> str:  # results name the work folder, not this machine's path
        return text.replace(str(work), "WORK")

    out = {"recipe": recipe, "ranks": ranks, "layout": spec["layout"], "vllm": use_vllm, "substituted": substituted,
           "stand_in": {k: portable(v) for k, v in settings.items() if k.startswith(("target.", "drafter."))},
           "commands": []}
    for command in spec["commands"]:
        if labels is not None and command["label"] not in labels:
            continue
        if command.get("rehearse") is False:  # installing, downloading, serving: the card's, not the CPU's
            out["commands"].append({"label": command["label"], "card": command["run"], "skipped": True,
                                    "returncode": 0, "stages": {}})
            continue
        clear(settings["run_dir"])
        trains = trains_drafter(command["run"])
        if trains:  # the counts this command's ranks write, not an earlier command's
            (Path(settings["run_dir"]) / "train" / "metrics.json").unlink(missing_ok=True)
        twins = None if use_vllm else engine_twins(command["run"])
        argv = rehearsed_argv(command["run"], {**settings, **({"eval.methods": twins} if twins else {})}, python)
        print(f"rehearse [{command['label']}]: {shlex.join(argv[1:])}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=REPO, env=env)
        entry = {"label": command["label"], "card": command["run"], "rehearsed": portable(shlex.join(argv[1:])),
                 "returncode": proc.returncode, "seconds": round(time.perf_counter() - start, 1),
                 "stages": stage_summary(settings["run_dir"], world=ranks)}
        for stage, acc in entry["stages"].items():
            acc["peak_fraction_of_layers"] = round(acc["layer_bytes_peak"] / max(1, acc["layer_bytes_total"]), 4)
            key = f"{command['label']}/{stage}"
            acc["verdict"] = ("within share" if acc["within_share"] else
                              "whole target, as the card says (it fits one GPU)" if key in whole else
                              f"NOT YET within share: {pending[key]}" if key in pending and not use_vllm
                              else "OVER SHARE")
        if not entry["stages"] and "train.dry_run=true" not in command["run"]:
            entry["note"] = "no target weights loaded through an accounted loader (accounting.record_target)"
        if trains and not proc.returncode:
            entry.update(rank_counts(Path(settings["run_dir"]) / "train" / "metrics.json"))
        out["commands"].append(entry)
        if proc.returncode:
            break
    out["failures"] = [f"{c['label']}: exit status {c['returncode']}" for c in out["commands"] if c["returncode"]]
    # every stage says what its ranks (or vLLM's workers) hold: one that recorded nothing is unproven
    out["failures"] += [f"{c['label']}: no rank recorded what it holds of the target" for c in out["commands"]
                        if not c["returncode"] and not c["stages"] and not c.get("skipped")
                        and "train.dry_run=true" not in c["card"]]
    out["failures"] += [f"{c['label']}: {c['idle_problem']}" for c in out["commands"] if c.get("idle_problem")]
    out["failures"] += [f"{c['label']}/{s}: rank peak {a['layer_bytes_peak']} B of layer weights > share "
                        f"{a['layer_bytes_share']} B" for c in out["commands"] for s, a in c["stages"].items()
                        if a["verdict"] == "OVER SHARE"]
    out["passed"] = not out["failures"]
    return out


def trains_drafter(run: str) -> bool:
    """A card command that runs the train stage (alone or in `run`), not a dry run."""
    words = shlex.split(run)
    return words[:3] == ["python", "-m", "specforge_lite"] and len(words) > 3 and words[3] in COMMANDS \
        and runs(words[3], "train") and "train.dry_run=true" not in words


def rank_counts(metrics_path: Path) -> dict:
    """Every rank's real tokens and the steps it trained on none (the train stage's metrics.json),
    with `idle_problem` when a rank idled in some step or no counts were written."""
    if not metrics_path.exists():
        return {"idle_problem": f"{metrics_path.name} not written: no per-rank counts to check"}
    metrics = json.loads(metrics_path.read_text())
    tokens, idle = metrics.get("tokens_per_rank"), metrics.get("idle_steps_per_rank")
    if tokens is None or idle is None:
        return {"idle_problem": f"{metrics_path.name} holds no per-rank counts"}
    counts = {"real_tokens_per_rank": tokens, "idle_steps_per_rank": idle, "steps": metrics.get("steps"),
              "batching": metrics.get("batching")}
    idle_ranks = [f"rank {r} in {n} step(s)" for r, n in enumerate(idle) if n or not tokens[r]]
    if idle_ranks:
        counts["idle_problem"] = "trained on no real token: " + ", ".join(idle_ranks)
    return counts


def report(result: dict) -> str:
    lines = [f"rehearsal of {result['recipe']} on {result['ranks']} CPU ranks"
             + (f" ({result['substituted']})" if result["substituted"] else "")]
    for command in result["commands"]:
        if command.get("skipped"):
            lines.append(f"  {command['label']}: on the GPU node only (not rehearsed)")
            continue
        lines.append(f"  {command['label']}: exit {command['returncode']}, {command['seconds']} s"
                     + (f" ({command['note']})" if command.get("note") else ""))
        if command.get("real_tokens_per_rank"):
            lines.append(f"    real tokens per rank {command['real_tokens_per_rank']} over {command['steps']} steps, "
                         f"steps with none {command['idle_steps_per_rank']}")
        for stage, acc in command["stages"].items():
            per_rank = ", ".join(f"{r if r.startswith('vllm') else f'r{r}'} {b / 1e6:.2f}" for r, b in acc["ranks"].items())
            lines.append(f"    {stage:<9} layer weights held (MB) {per_rank} of {acc['layer_bytes_total'] / 1e6:.2f}; "
                         f"share {acc['layer_bytes_share'] / 1e6:.2f}: {acc['verdict']}")
    lines.append("PASSED" if result["passed"] else "FAILED: " + "; ".join(result["failures"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specforge_lite.scale.rehearse", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?")
    parser.add_argument("--ranks", type=int, default=None, help="CPU ranks (default: the recipe's rehearsal.ranks)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the stand-in and the run")
    parser.add_argument("--no-vllm", action="store_true",
                        help="rehearse without vLLM even where it is installed (hf sampling, our engine's twins)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where rehearse_RECIPE.json goes")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter that runs each card command (default: this one)")
    parser.add_argument("--cards", action="store_true", help="write every recipe card's commands section")
    args = parser.parse_args(argv)
    if args.cards:
        for path in sorted(RECIPES.glob("*/commands.yaml")):
            print(f"{(path.parent / 'README.md').relative_to(REPO)}: {'written' if write_card(path.parent.name) else 'up to date'}")
        return 0
    if not args.recipe:
        parser.error("name a recipe (or --cards)")
    spec = load_spec(args.recipe)
    ranks = args.ranks or spec["rehearsal"]["ranks"]
    if ranks < 1:
        parser.error("--ranks must be at least 1")
    use_vllm = vllm_available() and not args.no_vllm
    if not use_vllm:
        print("rehearsing without vLLM (" + ("--no-vllm" if args.no_vllm else "not installed: make vllm")
              + "): sampling and evaluate are substituted and stay pending", flush=True)
    work = args.work or REPO / "runs" / f"rehearse_{args.recipe}"
    result = rehearse(args.recipe, ranks, work, use_vllm, python=args.python)
    print(report(result))
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"rehearse_{args.recipe}.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    # each run says when, where and on which code it ran (the runs of one file may differ)
    result.update(date=time.strftime("%Y-%m-%d %H:%M"), machine=machine(), cpu=cpu_model(), **source_state())
    merged.setdefault("runs", {})[str(ranks)] = result
    path.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"written {path}")
    if args.results == RESULTS:  # the card says what the recorded rehearsal found
        write_card(args.recipe)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
