"""Write the training rows our recipe uses in the on-disk layout `speculators train` reads.

Runs with OUR environment (it composes our config and tokenizes with our code), so the
peer trainer sees exactly the token sequences and loss masks our trainer sees:

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.peers.make_speculators_data OUT \
        --conversations 200 --val 4 [hydra overrides of our recipe ...]

OUT then holds
- `rows.jsonl`: one `{"input_ids", "loss_mask"}` per conversation: the first `--conversations`
  rows are `training_rows()` of `+recipe=eagle_smollm2 train.use_samples=false
  train.source_conversations=N` (what our train stage trains on), followed by `--val` more
  (the next training-split conversations), which speculators holds out for validation
  (its `train_data_ratio` must be < 1);
- `hidden_states/hs_{i}.safetensors`: `token_ids` [T] and `hidden_states` [T, 4, H] (bf16):
  the target's hidden states entering decoder layers 2, 15 and 27 (HF `hidden_states[i]`,
  vLLM's and our aux ids) and the LAST decoder layer's output BEFORE the final norm
  (what vLLM's extractor writes; transformers 5's `hidden_states[-1]` is after the norm,
  so it is captured with a hook on the norm's input);
- `token_freq.pt`: counts of the assistant (loss-masked) tokens of the training rows, from
  which speculators picks its draft vocabulary (ours counts the same tokens);
- `target_dir.txt`: the local target folder (the cached SmolLM2 conversion) to pass as
  `--verifier-name-or-path`.

`benchmarks/peers/train_speculators.py` (run with the peer's environment) turns rows.jsonl
into the Arrow dataset speculators loads and trains.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.common import compose_config, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--conversations", type=int, required=True, help="training conversations (our N)")
    parser.add_argument("--val", type=int, default=4, help="extra conversations after them for the peer's validation")
    parser.add_argument("overrides", nargs="*", help="more hydra overrides of our recipe")
    args = parser.parse_args()

    from specforge_lite.stages.train import training_rows
    from specforge_lite.targets.loading import load_target, resolve_target_path

    n = args.conversations
    cfg = compose_config(["+recipe=eagle_smollm2", "train.use_samples=false",
                          f"train.source_conversations={n + args.val}", *args.overrides])
    model, tokenizer = load_target(cfg.target)
    rows = training_rows(cfg, tokenizer)
    # the first n are exactly what `train.source_conversations=n` trains on (the loop is sequential)
    ours = training_rows(compose_config(["+recipe=eagle_smollm2", "train.use_samples=false",
                                         f"train.source_conversations={n}", *args.overrides]), tokenizer)
    assert [r["input_ids"] for r in rows[:n]] == [r["input_ids"] for r in ours], "row order changed"

    layers = model.model.layers
    aux = list(cfg.drafter.aux_layer_ids or [2, len(layers) // 2, len(layers) - 3])
    captured = {}
    model.model.norm.register_forward_pre_hook(lambda _m, inputs: captured.__setitem__("last", inputs[0]))

    hs_dir = args.out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    for stale in hs_dir.glob("hs_*.safetensors"):  # a longer earlier run's extra rows
        if int(stale.stem[3:]) >= len(rows):
            stale.unlink()
    freq: Counter[int] = Counter()
    with (args.out / "rows.jsonl").open("w") as f:
        for i, row in enumerate(rows):
            ids = torch.tensor(row["input_ids"])
            path = hs_dir / f"hs_{i}.safetensors"
            if not (path.exists() and torch.equal(load_file(str(path))["token_ids"], ids)):  # resumable
                with torch.no_grad():
                    out = model(ids[None], output_hidden_states=True)
                states = [out.hidden_states[a][0] for a in aux] + [captured["last"][0]]
                save_file({"token_ids": ids, "hidden_states": torch.stack(states, 1).to(torch.bfloat16).contiguous()},
                          str(path))
            if i < n:
                freq.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
            f.write(json.dumps({"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}) + "\n")
            print(f"{i + 1}/{len(rows)} {len(ids)} tokens", flush=True)
    torch.save(dict(freq), args.out / "token_freq.pt")
    (args.out / "target_dir.txt").write_text(resolve_target_path(cfg.target.path) + "\n")
    (args.out / "meta.json").write_text(json.dumps({"train_conversations": n, "val_conversations": args.val,
                                                    "aux_layer_ids": aux, "rows": len(rows)}, indent=1) + "\n")


if __name__ == "__main__":
    run(main)
