"""The drafter contract: what every drafter provides, in one low module.

A drafter is a package under `specforge_lite/drafters/NAME/` listed once in
`specforge_lite.drafters.registry.DRAFTERS`. Its `__init__.py` exposes the module-level names
below (`DrafterModule` spells them out); the stages call nothing else, and nothing
outside the drafter's folder branches on its name.

Decoding side: the engine drives any object with the `Drafter` interface (n-gram lookup
and draft models in `decoding/drafters.py`, trained drafters through their module's
`decoder`), handing it a `DraftContext` before each proposal and reading back a
`DraftProposal`. This module imports nothing from `drafters/` and `decoding/` imports
nothing from `drafters/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked from logits; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


# --------------------------------------------------------------------------- decoding


@dataclass
class DraftContext:
    """What a drafter sees before each proposal (batch 1).

    token_ids: prompt + emitted tokens; the last one (the "pending" token) was chosen
        by the target but has not been fed through it yet. Read-only for drafters.
    num_prompt_tokens: how many of token_ids are the prompt.
    hidden_states: {layer index: [1, n, H]} target hidden states, for the layers the
        drafter declared, at the n positions the target's last forward committed:
        token_ids[-1 - n : -1] (the prompt after prefill; the previous pending token
        and the accepted drafts after a verify step).
    sampling: the temperature / top-p the target uses; a sampling drafter must draw
        from `warp_probs(draft_logits, sampling)` and return those probabilities.
    generator: the random stream for the drafter's draws.
    """

    token_ids: list[int]
    num_prompt_tokens: int
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    sampling: SamplingParams = GREEDY
    generator: torch.Generator | None = None


@dataclass
class DraftProposal:
    """tokens: up to k draft ids (target vocabulary); probs: [len(tokens), V] the draft
    distributions they were drawn from, over the target's vocabulary (a reduced-vocab
    drafter such as EAGLE-3 scatters its q through d2t), after the same `warp_probs`
    as the target; None in greedy mode or for a deterministic drafter (n-gram).
    confidence: in greedy mode, the drafter's probability of each token it drafted (EAGLE-2's
    confidence: a hybrid cuts the draft where more tokens do not pay); None where not given."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None


class Drafter(Protocol):
    """The engine's view of a drafter.

    - `hidden_state_layers`: the target hidden states it needs, as Hugging Face
      `output_hidden_states` indices (k < L is the input of decoder layer k, L the
      final-norm output, negative indices count from the end);
    - `reset()`: a new sequence starts;
    - `propose(ctx, k)`: up to k draft tokens after `ctx.token_ids` (called once per
      decoding step, also with k = 0 on a last step, so it sees every committed position);
    - `accept(num_accepted)`: how many of the last proposal the target kept (roll back
      own state);
    - `sequential`: True if drafting costs one drafter forward per token (the best-k
      estimate then scales the measured draft time with k);
    - optional `compile(k, capacity) -> seconds`: build compiled graphs for drafting k
      tokens with room for `capacity` positions, before anything is timed. The evaluate
      stage calls it when the target runs compiled (`eval.engine`), so drafter and target
      go through the same mechanism (`runtime/graph_cache.compile_kept`: on a CPU packages
      kept between runs; its `graph_source`, "compiled" or "loaded", goes in the report);
      a drafter without it drafts eagerly;
    - optional `propose_tree(ctx, depth, branch, nodes) -> decoding.tree.DraftTree`: a draft
      tree instead of a chain (paths of at most `depth` drafts, at most `branch` children a
      node, `nodes` nodes in all), called once per step as `propose` is (also with depth 0);
      `accept` then gets the accepted path's length. A drafter without it cannot branch
      (`eval.tree` refuses it).
    """

    name: str
    hidden_state_layers: tuple[int, ...]
    sequential: bool

    def reset(self) -> None: ...

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal: ...

    def accept(self, num_accepted: int) -> None: ...


# --------------------------------------------------------------------------- dry runs


@dataclass
class DrySize:
    """What a drafter adds to a training rank's memory, for `train.dry_run=true`.

    trainable_params: parameters with gradients and AdamW state (fp32).
    frozen_bytes: weights the drafter holds beside the target without training them.
    aux_layers: target hidden states it reads besides the last (the offline cache stores them).
    activation_bytes / target_logits_bytes: largest activations of one micro-batch of the
    given batch and sequence length, in the drafter and in the target's soft labels.
    facts: what `dry_run.json` records about it; line: one line for the printout.
    """

    trainable_params: int
    facts: dict[str, Any]
    line: str
    activation_bytes: int
    target_logits_bytes: int
    frozen_bytes: int = 0
    aux_layers: int = 0


# --------------------------------------------------------------------------- a drafter's module


class DrafterModule(Protocol):
    """The names a drafter package exposes (see `drafters/eagle3/__init__.py`).

    Identity and config
      NAME: its name (registry key, `drafter=NAME`, eval method, `drafter` in its folder).
      Options: the typed options dataclass of the Hydra `drafter` group (`conf/drafter/NAME.yaml`).
      UNTRACKED_OPTIONS: option names that do not decide the weights (left out of the
        training fingerprint, e.g. what is only logged).
      SERVING_NOTE: a caveat the evaluation report repeats when it recommends this
        drafter, or None.
      VLLM_SERVING: (vLLM speculative method, export subfolder[, extra speculative_config
        keys]) when vLLM serves its export (evaluate's `vllm_NAME` method), or None.
      LLAMACPP_SERVING: (llama.cpp speculative type, draft GGUF file under export/gguf) when
        llama.cpp runs its GGUF export (`export.gguf=true`, evaluate's `llamacpp_NAME` method),
        else the one line that says why it cannot.
      These two are the only record of which engine serves which drafter; `drafters.methods`
        and `serving/` derive their method names and tables from them.
      DRAFTS_TREES (optional, False when absent): its decoder has `propose_tree`, so
        `drafters.methods` offers NAME_tree and NAME_mixed_tree (`eval.tree`).
    Training (the train stage, in this order)
      READS_LAST_HIDDEN: whether its training reads the target's last hidden state from the
        features (`train.feature_format=int4_topk` stores the teacher's top logits instead).
      build(cfg, target, token_counts) -> nn.Module
      target_layers(drafter) -> list[int]: hidden states read besides the last
      batch_preparer(drafter, target) -> prepare(batch, aux, last, own)
      loss_and_metrics(drafter, batch, cfg) -> (loss_sum, num_positions, metrics)
      trained_weights(drafter) -> dict (what a checkpoint holds)
      describe(drafter) -> str
      save(drafter, directory, extra); load(directory, target) -> nn.Module
    Decoding
      decoder(drafter) -> Drafter
    Export
      export(cfg, trained_dir, out_dir, target, tokenizer, k, k_source, verifier) -> dict,
        written into `out_dir` (a temporary folder the stage renames into place);
        the dict has `format`, `path` (relative to out_dir) and `speculative_tokens`.
    Dry runs
      dry_size(cfg, target_config, batch, seq) -> DrySize
    """

    NAME: str
    Options: type
    UNTRACKED_OPTIONS: tuple[str, ...]
    SERVING_NOTE: str | None
    VLLM_SERVING: tuple | None
    LLAMACPP_SERVING: tuple | str
    READS_LAST_HIDDEN: bool
    build: Callable
    target_layers: Callable
    batch_preparer: Callable
    loss_and_metrics: Callable
    trained_weights: Callable
    describe: Callable
    save: Callable
    load: Callable[[Path, Any], torch.nn.Module]
    decoder: Callable
    export: Callable
    dry_size: Callable
