"""llama.cpp in the loop on this CPU: the SmolLM2 target GGUF decoded by llama.cpp itself
(xllamacpp, in-process) plain, with its own n-gram drafter and with our drafters' GGUFs.

    python -m benchmarks.bench_llamacpp --run-dir runs/llamacpp_smollm2 --threads 2

Prompts: the demo's eval set (conf/recipe/eagle_smollm2.yaml: MT-Bench first turns, the
first `--prompts` of its fixed subset), rendered with SmolLM2's chat template; greedy,
exactly `--max-new-tokens` new tokens each (end of sequence ignored), batch 1. Methods run
one after another, each on its own llama.cpp server with one untimed warm-up prompt; run it
alone (llama.cpp's worker threads spin-wait and collapse when another job shares the cores).
Drafters: `RUN_DIR/export/speculators` (EAGLE-3) and, when present, a distilled draft model
export (`--distilled-dir`), written to GGUF beside them. tau uses llama.cpp's own counters.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, compose_config, update_doc_section, write_results


def bootstrap(tokens: np.ndarray, seconds: np.ndarray, accepted: np.ndarray, resamples: int = 2000,
              seed: int = 0) -> dict:
    """95% percentile intervals over prompts of tokens/s (sum tokens / sum seconds) and tau."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(tokens), size=(resamples, len(tokens)))
    rate = tokens[idx].sum(1) / seconds[idx].sum(1)
    tau = tokens[idx].sum(1) / (tokens[idx].sum(1) - accepted[idx].sum(1))
    return {"tokens_per_s_ci": [float(np.percentile(rate, 2.5)), float(np.percentile(rate, 97.5))],
            "tau_ci": [float(np.percentile(tau, 2.5)), float(np.percentile(tau, 97.5))]}


def prompts_of(overrides: list[str], count: int) -> tuple[list[list[int]], list[str]]:
    from omegaconf import OmegaConf

    from specforge_lite.data.chat import prompt_ids
    from specforge_lite.data.eval_prompts import load_prompts, select_prompts
    from specforge_lite.targets import load_tokenizer

    cfg = compose_config(overrides)
    tokenizer = load_tokenizer(OmegaConf.create({**OmegaConf.to_container(cfg.target), "device": "cpu"}))
    prompts = select_prompts(load_prompts(cfg), count)
    return ([prompt_ids(tokenizer, [{"role": "user", "content": p["turns"][0]}]) for p in prompts],
            [str(p["id"]) for p in prompts])


def run_method(method: str, target: Path, draft: Path | None, prompts: list[list[int]], args) -> dict:
    from specforge_lite.llamacpp.runner import LlamaCppRunner

    with LlamaCppRunner(target, method, draft_gguf=draft, threads=args.threads, speculative_tokens=args.k) as runner:
        runner.complete(prompts[0], args.max_new_tokens)  # warm-up, untimed
        done = [runner.complete(ids, args.max_new_tokens) for ids in prompts]
    tokens = np.array([len(c.tokens) for c in done], dtype=float)
    wall = np.array([c.wall_seconds for c in done])
    decode = np.array([c.seconds for c in done])
    accepted = np.array([c.accepted for c in done], dtype=float)
    entry = {"tokens": int(tokens.sum()), "tokens_per_s": float(tokens.sum() / wall.sum()),
             "decode_tokens_per_s": float(tokens.sum() / decode.sum()),
             "drafted": int(sum(c.drafted for c in done)), "accepted": int(accepted.sum()),
             "tau": float(tokens.sum() / (tokens.sum() - accepted.sum())), **bootstrap(tokens, wall, accepted),
             "outputs": [c.tokens for c in done]}
    print(f"{method}: {entry['tokens_per_s']:.1f} tok/s {entry['tokens_per_s_ci']}, tau {entry['tau']:.2f}", flush=True)
    return entry


MISMATCH_NOTE = ("\n\n`output = plain` counts the prompts whose greedy tokens equal llama.cpp plain's on the same "
                 "target file. A mismatch where llama.cpp's own n-gram drafter shows one too points at the engine: "
                 "on the quantised target a multi-token verification forward can round an argmax differently from "
                 "single-token decoding (the lossless tests, tests/integration/test_llamacpp.py, pass in f32 and on "
                 "short Q4_1 answers).")


def markdown(payload: dict) -> str:
    rows = ["| method | llama.cpp drafter | tokens/s (95% CI) | speedup | tau | output = plain |",
            "|---|---|---|---|---|---|"]
    plain = payload["methods"]["llamacpp_plain"]["tokens_per_s"]
    for name, e in payload["methods"].items():
        lo, hi = e["tokens_per_s_ci"]
        rows.append(f"| {name} | {e['spec_type'] or '-'} | {e['tokens_per_s']:.1f} ({lo:.1f}-{hi:.1f}) | "
                    f"{e['tokens_per_s'] / plain:.2f}x | {e['tau']:.2f} | {e['identical_to_plain']} |")
    skipped = "".join(f"\n- {name}: {why}" for name, why in payload["not_run"].items())
    return (f"## llama.cpp in the loop (SmolLM2)\n\n"
            f"llama.cpp (xllamacpp {payload['xllamacpp']}) at {payload['threads']} threads, target "
            f"`{payload['target']}` ({payload['target_precision']}), {payload['num_prompts']} MT-Bench first turns, "
            f"{payload['max_new_tokens']} new tokens, greedy, k={payload['k']}; tokens/s over the whole request "
            f"(prompt included), intervals: percentile bootstrap over prompts; tau = tokens / target forwards "
            f"from llama.cpp's draft counters (bonus token included). EAGLE-3 drafter: {payload['drafter_budget']}."
            f"\n\n" + "\n".join(rows) + (f"\n\nNot run:{skipped}" if skipped else "") + MISMATCH_NOTE +
            f"\n\nCommand: `{payload['command']}`\n")


def rewrite_doc() -> None:
    """Regenerate the docs section from the recorded results (no new measurement)."""
    payload = json.loads((RESULTS / "llamacpp_smollm2.json").read_text())
    update_doc_section("llamacpp_smollm2", markdown(payload))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--distilled-dir", type=Path, default=None, help="a distilled draft model export (HF dir)")
    parser.add_argument("--overrides", default="+recipe=eagle_smollm2")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--drafter-budget", default="see the run's train/ folder")
    args = parser.parse_args()

    from specforge_lite.llamacpp.gguf_export import eagle3_to_gguf, llama_to_gguf, smollm2_gguf
    from specforge_lite.llamacpp.runner import METHODS, SPEC_TYPE_FLAGS, version
    from specforge_lite.targets import SMOLLM2_GGUF

    target = smollm2_gguf()
    prompts, ids = prompts_of(shlex.split(args.overrides), args.prompts)
    gguf_dir = args.run_dir / "export" / "gguf"
    drafts, not_run = {}, {}
    speculators = args.run_dir / "export" / "speculators"
    if speculators.is_dir():
        drafts["llamacpp_eagle3"] = eagle3_to_gguf(speculators, target, gguf_dir / "eagle3.gguf")
    else:
        not_run["llamacpp_eagle3"] = f"no EAGLE-3 export in {speculators}"
    if args.distilled_dir is not None:
        drafts["llamacpp_distilled"] = llama_to_gguf(args.distilled_dir, gguf_dir / "draft_model.gguf",
                                                     vocab_gguf=target)
    else:
        not_run["llamacpp_distilled"] = "no distilled draft model was trained for this run"
    methods = {}
    for method in ("llamacpp_plain", "llamacpp_ngram", "llamacpp_eagle3", "llamacpp_distilled"):
        if method in not_run:
            continue
        methods[method] = run_method(method, target, drafts.get(method), prompts, args)
        methods[method]["spec_type"] = SPEC_TYPE_FLAGS.get(METHODS[method])
    plain = methods["llamacpp_plain"]["outputs"]
    for entry in methods.values():
        entry["identical_to_plain"] = f"{sum(a == b for a, b in zip(entry.pop('outputs'), plain))}/{len(plain)}"
    command = "python -m benchmarks.bench_llamacpp " + shlex.join(sys.argv[1:])
    payload = {"xllamacpp": version(), "threads": args.threads, "target": SMOLLM2_GGUF, "target_precision": "Q4_1",
               "num_prompts": len(prompts), "prompt_ids": ids, "max_new_tokens": args.max_new_tokens, "k": args.k,
               "drafter_budget": args.drafter_budget, "methods": methods, "not_run": not_run, "command": command}
    path = write_results("llamacpp_smollm2", payload)
    update_doc_section("llamacpp_smollm2", markdown(payload))
    print(f"wrote {path} and docs/BENCHMARKS.md section 'llamacpp_smollm2'")


if __name__ == "__main__":
    main()
