"""Speculative decoding (batch 1) over Hugging Face causal LMs.

Proposers (what drafts; the `Drafter` interface is `specforge_lite.contract`):
- `drafters`: n-gram lookup, a draft model used as it is, the replay and mixed-tree drafters;
- `suffix`: suffix decoding over the request and the target's samples;
- `arctic`: Arctic Inference's own suffix decoding, as a peer proposer;
- `hybrid`: `<drafter>_hybrid`, suffix lookup or the trained drafter each step;
- `policy`: which source a hybrid step drafts from, and how long.
Acceptance and the loop:
- `verify`: the chain acceptance rules (greedy, rejection sampling) as pure functions;
- `tree`: draft trees, their one-forward verify and their acceptance rules;
- `engine`: our plain loop, chain and tree speculative decoding with KV caches;
- `peers`: Hugging Face's own decoders, measured in the same table.
What an evaluate measures of it and its report (metrics, intervals, identity verdicts, checks, the
choices, the recommendation) are `specforge_lite/measurement/`. The target's surgery (a truncated copy as a draft model) is `targets/surgery.py`; the sample
stage's generator is `stages/sample_backends.py`.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data')
