"""Trainable drafters, one file each: `eagle3`, `medusa`, `distill` (the `draft_model` kind).

The train stage drives every drafter through the same few module-level functions:

- `build(cfg, target, token_counts) -> nn.Module`: a drafter for this target, with its
  draft vocabulary (where it has one) taken from the loss-masked token counts.
- `target_layers(drafter) -> list[int]`: the target hidden states (HF
  `output_hidden_states` indices) it reads besides the final hidden state.
- `batch_preparer(drafter, target) -> prepare(batch, aux, last, own)`: fills a collated
  micro-batch with what the loss needs from the target (soft labels, the `valid`
  positions) and `num_positions`, the count the gradient is normalised by; `own` is
  False on a rank that only runs a dummy share (no positions).
- `loss_and_metrics(drafter, batch, cfg) -> (loss_sum, num_positions, metrics)`, with
  metrics `correct` / `total` per step or head and `chain` (consecutive correct drafts,
  for the simulated acceptance length).
- `trained_weights(drafter)` (what a checkpoint holds) and `save(drafter, directory, extra)`;
  `describe(drafter)`, one line for the log.
"""
