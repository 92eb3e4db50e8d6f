"""Record the side-by-side evaluation of our drafter and a speculators-trained one.

    python -m benchmarks.peers.record_peer_compare runs/peer_compare \
        --ours runs/peer_ours/train/drafter --peer runs/peer_speculators/checkpoint_best \
        --command "..." --ours-command "..." --peer-command "..." --data-command "..." \
        --ours-wall "..." --peer-wall "..." --data-wall "..." --eval-wall "..." --peer-versions "..."

Writes benchmarks/results/peer_compare.json and the `peer_compare` section of
docs/BENCHMARKS.md: the method table of `RUN/eval/report.json` (the evaluate run that
decoded both drafters), how each drafter was trained, and every difference between the
two trainings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import needed, run, run_file, update_doc_section, write_results
from specforge_lite.measurement.report import methods_table


def ours_summary(drafter: Path) -> dict:
    history = json.loads(needed(drafter.parent / "metrics.json", "python -m specforge_lite train "
                                "+recipe=eagle_smollm2 (benchmarks/peers/README.md, step 3)").read_text())["history"]
    last = history[-1]
    return {"dir": str(drafter), "steps": last["step"], "tokens": last.get("tokens_seen"),
            "final_loss": last["loss"], "final_simulated_tau": last.get("simulated_tau"), "acc": last.get("acc")}


def peer_summary(drafter: Path) -> dict:
    folder = drafter.resolve()
    config = json.loads(needed(folder / "config.json", "benchmarks/peers/train_speculators.py "
                               "(benchmarks/peers/README.md, step 3)").read_text())
    state = json.loads((folder / "training_state.json").read_text()) if (folder / "training_state.json").exists() else {}
    val = json.loads((folder / "val_metrics.json").read_text()) if (folder / "val_metrics.json").exists() else {}
    return {"dir": str(drafter), "steps": state.get("global_step"), "val_metrics": val,
            "speculators_version": config.get("speculators_version"),
            "transformers_version": config.get("transformers_version"),
            "norm_before_fc": config.get("norm_before_fc"), "norm_output": config.get("norm_output"),
            "draft_vocab_size": config.get("draft_vocab_size"), "dtype": config.get("dtype"),
            "aux_layer_ids": config.get("eagle_aux_hidden_state_layer_ids")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--ours", type=Path, required=True)
    parser.add_argument("--peer", type=Path, required=True)
    for name in ("command", "ours-command", "peer-command", "data-command"):
        parser.add_argument(f"--{name}", required=True)
    for name in ("eval-wall", "ours-wall", "peer-wall", "data-wall", "peer-versions", "note"):
        parser.add_argument(f"--{name}", default="")
    args = parser.parse_args()

    report = run_file(args.run_dir, "eval/report.json")
    ours, peer = ours_summary(args.ours), peer_summary(args.peer)
    write_results("peer_compare", {
        "command": args.command, "eval_wall": args.eval_wall,
        "ours": {**ours, "command": args.ours_command, "wall": args.ours_wall},
        "peer": {**peer, "command": args.peer_command, "wall": args.peer_wall, "versions": args.peer_versions},
        "data": {"command": args.data_command, "wall": args.data_wall},
        "report": report})
    prompts = ", ".join(p["id"] for p in report["prompts"])
    val = peer["val_metrics"]
    val_text = ", ".join(f"{k.removesuffix('_epoch')} {val[k]:.3f}" for k in
                         ("full_acc_0_epoch", "full_acc_1_epoch", "full_acc_2_epoch", "loss_epoch") if k in val) or "n/a"
    m = report["methods"]
    ranked = " > ".join(f"{name} {m[name]['tau']:.2f}" for name in sorted(("ours", "speculators"), key=lambda n: -m[n]["tau"]))
    update_doc_section("peer_compare", f"""## A drafter trained here next to one trained by speculators (SmolLM2, CPU)

One `evaluate` that decodes, with our engine, an EAGLE-3 drafter trained
here and one trained by the peer trainer speculators ({peer['speculators_version']}, from PyPI), both
for SmolLM2-135M-Instruct on the same conversations. The speculators folder is read as it
was written (its own `config.json` and bf16 `model.safetensors`, `norm_before_fc` and
`norm_output` on), detected as the speculators layout by `eval.extra_drafters`.

Command (one run, {args.eval_wall} wall on this machine):
`{args.command}`

Evaluation: {report['num_prompts']} MT-Bench first turns (ids {prompts}), greedy,
k = {report['settings']['num_draft_tokens']}, up to {report['settings']['max_new_tokens']} new tokens, batch 1, methods interleaved per prompt.

{methods_table(report)}

Tau at this budget: {ranked}; neither drafter pays for its draft step on this CPU (both
slower than plain; ngram is the best method here), and both keep the output identical to
plain decoding. 8 prompts of up to 128 tokens are a small sample: the gap between the two
is a few hundredths of tau.

Data, both trainers: the first 100 training-split ShareGPT conversations as our recipe
reads them (`+recipe=eagle_smollm2 train.use_samples=false train.source_conversations=100`:
the conversation text as written, chat-templated by SmolLM2's template, truncated to 512
tokens, loss on the assistant tokens), one epoch. The same token ids and loss masks were
handed to speculators ({args.data_wall} to extract, `{args.data_command}`), with the target's
hidden states at the aux layers [2, 15, 27] and the last layer's output before the final
norm, as vLLM's extractor writes them; 4 further conversations form the validation split it
requires (it trains on exactly the same 100).

- ours ({args.ours_wall}): `{args.ours_command}`: {ours['steps']} one-sequence steps, AdamW lr 1e-3
  with 3% warm-up and cosine decay, fp32, draft vocab 8192, 3 TTT steps, final training loss
  {ours['final_loss']:.3f}, final simulated tau {ours['final_simulated_tau']:.2f}.
- speculators ({args.peer_wall}): `{args.peer_command}`: {peer['steps']} steps of 512-token packed
  sequences, its defaults otherwise (Muon + AdamW lr 1e-3, linear schedule, bf16 autocast,
  KL loss, TTT loss decay 1.0, `norm_before_fc` and `norm_output` on, 2048-token sliding
  window); draft vocab 8192, 3 TTT steps; validation {val_text}.
  Versions: {args.peer_versions}.

Differences between the two trainings, all the peer's defaults or what a CPU needs: its
optimizer (Muon), schedule, precision (bf16) and EAGLE-3.1 norms; it packs conversations
into 512-token windows ({peer['steps']} steps here against our {ours['steps']} one-conversation steps: most
rows are already 512 tokens long); on this CPU it runs with its
own `--loss-implementation eager` (its fused loss needs Triton) and `--draft-attn-impl sdpa`
(instead of its flex-attention default; both are speculators' options) and two run-time patches (device "cpu", no accelerator sync;
`benchmarks/peers/train_speculators.py`). The budget is small on purpose (2 shared cores,
about 10 other processes): 100 conversations, one epoch, so both drafters are far from
trained; the comparison is of the two trainers at the same tiny budget, decoded by the same
engine. {args.note}

Reproduce: `benchmarks/peers/README.md`.
""")
    print(json.dumps({m: {"tau": v["tau"], "speedup": v["speedup"]} for m, v in report["methods"].items()}))


if __name__ == "__main__":
    run(main)
