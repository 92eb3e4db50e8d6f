"""Speculative decoding (batch 1) over Hugging Face causal LMs.

- `verify`: the acceptance rules (greedy, rejection sampling) as pure functions;
- `drafters`: n-gram lookup and a draft model used as it is (the `Drafter` interface is
  `specforge_lite.contract`);
- `engine`: our plain loop and chain speculative decoding with KV caches;
- `peers`: Hugging Face's own decoders, measured in the same table;
- `metrics`: tau, per-position acceptance, forward costs and the best k.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data')
