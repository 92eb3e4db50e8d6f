"""Train an EAGLE-3 drafter for SmolLM2 with speculators (the peer trainer) on this CPU.

Runs with the PEER's environment (speculators 0.9.0, see benchmarks/peers/README.md), on
the folder `make_speculators_data.py` wrote with ours:

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv-peer/bin/python benchmarks/peers/train_speculators.py \
        runs/peer_data runs/peer_speculators [extra `speculators train` flags ...]

1. `rows.jsonl` becomes the Arrow dataset `speculators prepare-data` writes for
   speculator-format rows (`input_ids`, `loss_mask` as int64 tensors, `seq_len`; torch
   format), in the same order as `hidden_states/hs_{i}.safetensors`, and `token_freq.pt`
   is counted by speculators' own `save_token_frequency_distribution` over the training
   rows only (the first `train_conversations`; the rest are its validation split).
2. `speculators train` (its `TrainConfig.resolve` + `train.cli.main`, what the
   `speculators train` command runs) trains with its defaults except the flags below.

Two run-time patches, nothing else changed in the peer's code (speculators 0.9 assumes an
accelerator): the trainer's device is "cpu" (its `local_rank`, the autocast device type
and the checkpointer's load device), and `torch.accelerator.synchronize` (step timing) is
a no-op when there is no accelerator. Its Triton-fused loss has an eager implementation
(`--loss-implementation eager`) and its flex-attention default an SDPA one
(`--draft-attn-impl sdpa`): both are speculators' own options.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def build_dataset(data: Path) -> int:
    """The Arrow dataset and token frequencies speculators reads; returns the training rows."""
    from datasets import Dataset

    from speculators.train.vocab_mapping import save_token_frequency_distribution

    meta = json.loads((data / "meta.json").read_text())
    rows = [json.loads(line) for line in (data / "rows.jsonl").read_text().splitlines()]
    if not (data / "state.json").exists():
        dataset = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows],
                                     "loss_mask": [r["loss_mask"] for r in rows],
                                     "seq_len": [len(r["input_ids"]) for r in rows]})
        dataset.set_format(type="torch")
        dataset.save_to_disk(str(data))
    freq = data / "token_freq.pt"
    freq.unlink(missing_ok=True)  # ours wrote one; let speculators count its own
    train_rows = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows[:meta["train_conversations"]]],
                                    "loss_mask": [r["loss_mask"] for r in rows[:meta["train_conversations"]]]})
    train_rows.set_format(type="torch")
    save_token_frequency_distribution(train_rows, freq)
    return meta["train_conversations"], len(rows)


def patch_for_cpu() -> None:
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer

    if torch.accelerator.current_accelerator() is not None:
        return
    torch.accelerator.synchronize = lambda *a, **k: None
    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    init = trainer.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = cpu_init


def main() -> None:
    data, out, extra = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    n, total = build_dataset(data)
    patch_for_cpu()

    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    target = (data / "target_dir.txt").read_text().strip()
    argv = ["--verifier-name-or-path", target, "--data-path", str(data), "--speculator-type", "eagle3",
            "--save-path", str(out), "--log-dir", str(out / "logs"),
            # exactly the first n rows train, the rest validate (it needs a validation split)
            "--train-data-ratio", repr((n + 0.5) / total),
            "--on-missing", "raise", "--num-workers", "0",
            "--loss-implementation", "eager", "--draft-attn-impl", "sdpa", *extra]
    print("speculators train " + " ".join(argv), flush=True)
    train_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main()
