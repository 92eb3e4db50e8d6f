"""What the train stage is built from: features and their formats, losses, optimisers, checkpoints, tracking, strategies.

Modules:
- `batching`: a run's rows cut into micro-batches per rank;
- `checkpoints`: one checkpoint write path for every strategy;
- `feature_formats`: how the offline feature cache stores a hidden-state tensor;
- `features`: what the frozen target contributes to a batch, online or from disk;
- `health`: what makes a run's output worth keeping, checked while it runs;
- `losses`: distillation losses as pure functions;
- `optim`: AdamW, or Muon with AdamW;
- `strategies/`: how the train stage spreads over ranks;
- `throughput`: per-rank real tokens, tokens/s and MFU;
- `tracking`: step metrics, the experiment tracker and the learning curve.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data')
