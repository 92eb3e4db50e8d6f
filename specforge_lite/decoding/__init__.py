"""Speculative decoding (batch 1) over Hugging Face causal LMs, in rooms a reader can name.

Proposers: what drafts (`propose`, `propose_tree`; the `Drafter` interface is `specforge_lite.contract`;
trained drafters' proposers are each drafter folder's `decode.py`):
- `drafters`: n-gram lookup, a draft model used as it is, the replay and mixed-tree drafters;
- `request_index`: the request's own tokens indexed for lookup, one index for n-gram and suffix;
- `suffix`: suffix decoding over the request and the target's samples;
- `arctic`: Arctic Inference's own suffix decoding, as a peer proposer;
- `hybrid`: `<drafter>_hybrid`, suffix lookup or the trained drafter each step.
The verifier: where acceptance is decided:
- `verify`: every acceptance rule, chains and trees, greedy and sampled, behind `verify.accept`;
- `tree`: the draft tree itself: its shape, its layout for one verify forward, the rows it keeps.
The loop:
- `engine`: plain decoding and the one speculative loop (a chain is the one-branch tree).
The policy and the cost model: how much to draft and from which source:
- `policy`: which source a hybrid step drafts from, priced by expected tokens per second;
- `cost`: what a verify forward of each width costs: the measured curve, then the loop's own timings.
Peers:
- `peers`: Hugging Face's own decoders, measured in the same table.

Where a step's cost comes from: the engine times each verify forward and reports it
(`observe_verify`) to the cost model, which starts from the evaluate's measured curve. What an
evaluate measures of decoding and how its report says it (metrics, intervals, identity verdicts,
checks, the choices, the recommendation) is `specforge_lite/measurement/`. The target's surgery (a
truncated copy as a draft model) is `targets/surgery.py`; the sample stage's generator is
`stages/sample_backends.py`. docs/ARCHITECTURE.md draws the house.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data')
