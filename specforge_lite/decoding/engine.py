"""The decoding loop over a Hugging Face causal LM with a KV cache (batch 1).

`generate_plain` is the baseline: one target forward per token. Speculative decoding is one loop
(`_decode`) for chains and trees, a chain being the one-branch tree; each step:

1. the drafter proposes up to k tokens after the committed tokens (a tree: `propose_tree`);
2. one target forward runs over the pending token and the k drafts, extending the
   target's KV cache (the committed prefix is never recomputed);
3. the verifier (`verify.accept`) keeps a path of the drafts and picks the next token
   (the correction, or the bonus token below the last draft kept);
4. the target's KV cache is cropped to drop the rejected drafts, and the drafter
   is told how many it got right so it can roll back its own state (and, where it
   has `observe_verify`, the width and measured seconds of that verify forward);
5. the kept drafts and the next token are emitted; stop on EOS or max_new_tokens.

`generate_speculative` runs it over a chain drafter's `propose` (a causal verify forward, the
cache cropped), `generate_tree` over `propose_tree` (one verify forward of every node under the
tree mask, `tree.py`, and a cache compacted to the accepted path, `runner.keep_rows`).

Convention for tau: the prefill forward and the first token it yields are not a
decoding step, so tau = (tokens emitted - 1) / decoding forwards, bonus token
included; plain decoding scores exactly 1.00 (Spec-Bench's convention).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from specforge_lite.contract import DraftContext, Drafter
from specforge_lite.decoding.drafters import MixedTreeDrafter, build_ngram, can_branch
from specforge_lite.runtime.hf_runner import TargetRunner  # noqa: F401  (the decoders' runner)
from specforge_lite.decoding.tree import DraftTree, TreeShape, path_rows, verify_layout
from specforge_lite.decoding.verify import GREEDY, SamplingParams, accept, pick_tokens


@dataclass
class Generation:
    """One generated answer and what it cost.

    tokens: the emitted ids (EOS included when it ended the answer).
    num_forwards: target forwards during decoding (prefill excluded).
    draft_limits / draft_lengths / accepted_lengths: per decoding step, the drafts the
    step allowed (k, less near max_new_tokens), proposed and kept.
    prefill_s: the prefill forward; target_s: decoding forwards of the target;
    draft_s: drafter calls; total_s: the whole call.
    confidences: per chain step, the drafter's confidence in each draft it proposed
    (`DraftProposal.confidence`; [] where it gave none): what `metrics.calibration` checks.
    """

    tokens: list[int]
    finish: str  # "eos" | "length"
    num_prompt_tokens: int
    num_forwards: int = 0
    draft_limits: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    target_s: float = 0.0
    draft_s: float = 0.0
    total_s: float = 0.0
    confidences: list[list[float]] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return (len(self.tokens) - 1) / self.num_forwards if self.num_forwards else 1.0

    def add_step(self, limit: int, drafted: int, accepted: int, draft_s: float, target_s: float) -> None:
        """One decoding step: one target forward over `drafted` drafts (of `limit` allowed)."""
        self.num_forwards += 1
        self.draft_limits.append(limit)
        self.draft_lengths.append(drafted)
        self.accepted_lengths.append(accepted)
        self.draft_s += draft_s
        self.target_s += target_s

    @property
    def overhead_s(self) -> float:
        """Decoding time spent outside target forwards and drafter calls (the loop itself)."""
        return max(self.total_s - self.prefill_s - self.target_s - self.draft_s, 0.0)


def _pick(logits: torch.Tensor, sampling: SamplingParams, generator) -> int:
    return int(pick_tokens(logits, sampling, generator))


def _truncate_at_eos(tokens: list[int], eos_ids: frozenset) -> tuple[list[int], bool]:
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i + 1], True
    return tokens, False


@torch.inference_mode()
def generate_plain(model, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
                   eos_ids: Iterable[int] = (), generator: torch.Generator | None = None,
                   runner: TargetRunner | None = None) -> Generation:
    """Autoregressive decoding, one target forward per token."""
    eos = frozenset(eos_ids)
    runner = runner or TargetRunner(model)
    clock = time.perf_counter
    start = clock()
    runner.reset()
    logits, _ = runner.forward(prompt_ids, last_only=True)
    token = _pick(logits[-1], sampling, generator)
    runner._sync()
    gen = Generation(tokens=[token], finish="length", num_prompt_tokens=len(prompt_ids))
    gen.prefill_s = clock() - start
    while token not in eos and len(gen.tokens) < max_new_tokens:
        t0 = clock()
        logits, _ = runner.forward([token], last_only=True)
        runner._sync()
        gen.target_s += clock() - t0
        token = _pick(logits[-1], sampling, generator)
        gen.tokens.append(token)
        gen.num_forwards += 1
    gen.finish = "eos" if token in eos else "length"
    gen.total_s = clock() - start
    return gen


def _prefill(runner, drafter, prompt_ids: list[int], sampling: SamplingParams, generator):
    """Both speculative loops' start: reset the target and the drafter, run the prompt, pick the
    first token. Returns the Generation (prefill time set), the drafter's context and that token."""
    start = time.perf_counter()
    runner.reset()
    drafter.reset()
    logits, hidden = runner.forward(prompt_ids, last_only=True)
    token = _pick(logits[-1], sampling, generator)
    runner._sync()
    gen = Generation(tokens=[token], finish="length", num_prompt_tokens=len(prompt_ids))
    ctx = DraftContext(token_ids=list(prompt_ids) + [token], num_prompt_tokens=len(prompt_ids),
                       hidden_states=hidden, sampling=sampling, generator=generator)
    gen.prefill_s = time.perf_counter() - start
    return gen, ctx, token


def _finished(gen: "Generation", max_new_tokens: int, eos: frozenset, total_s: float) -> "Generation":
    """Cut to max_new_tokens, say why it ended, stamp the total time."""
    gen.tokens = gen.tokens[:max_new_tokens]
    gen.finish = "eos" if gen.tokens[-1] in eos else "length"
    gen.total_s = total_s
    return gen


class _ChainVerify:
    """A chain (a one-branch tree) verified by the causal forward; the cache cropped to the path."""

    chain = True

    @staticmethod
    def forward(runner, token: int, tree: DraftTree, committed: int):
        return runner.forward([token] + tree.tokens)

    @staticmethod
    def keep(runner, committed: int, path: list[int], size: int) -> None:
        if len(path) < size:
            runner.crop(committed + 1 + len(path))

    @staticmethod
    def hidden(hidden: dict, path: list[int]) -> dict:
        return {layer: h[:, :len(path) + 1] for layer, h in hidden.items()}


class _TreeVerify:
    """A tree verified under its mask (`tree.verify_layout`); the cache keeps the root and the path,
    moved down to contiguous slots (`runner.keep_rows`)."""

    chain = False

    @staticmethod
    def forward(runner, token: int, tree: DraftTree, committed: int):
        positions, mask = verify_layout(tree, committed)
        return runner.forward_tree([token] + tree.tokens, positions, mask)

    @staticmethod
    def keep(runner, committed: int, path: list[int], size: int) -> None:
        runner.keep_rows(committed, path_rows(path))

    @staticmethod
    def hidden(hidden: dict, path: list[int]) -> dict:
        index = torch.tensor(path_rows(path), device=next(iter(hidden.values())).device)
        return {layer: h.index_select(1, index) for layer, h in hidden.items()}


def _chain_proposer(drafter, num_draft_tokens: int):
    """A chain drafter's step as a one-branch tree: (the depth allowed, propose(ctx, depth) ->
    (tree, the drafter's confidence in each draft; [] where it gave none))."""
    def propose(ctx: DraftContext, depth: int):
        proposal = drafter.propose(ctx, depth)  # also at depth 0, so a drafter sees every committed position
        tokens = proposal.tokens[:depth]
        probs = proposal.probs[:len(tokens)] if proposal.probs is not None else None
        return DraftTree.chain(tokens, probs), list(proposal.confidence or [])[:len(tokens)]
    return num_draft_tokens, propose


def _tree_proposer(drafter, shape: TreeShape):
    """A tree drafter's step within `shape` (confidences None: a tree step records none)."""
    def propose(ctx: DraftContext, depth: int):
        tree = drafter.propose_tree(ctx, depth, shape.branch, shape.nodes)
        if len(tree) > shape.nodes or (len(tree) and max(tree.depths()) > depth):
            raise RuntimeError(f"{drafter.name} proposed {len(tree)} nodes of depth up to {max(tree.depths())}; "
                               f"the step allowed {shape.nodes} nodes of depth {depth}")
        return tree, None
    return shape.depth, propose


@torch.inference_mode()
def _decode(model, drafter, prompt_ids: list[int], max_new_tokens: int, proposer, verify, sampling: SamplingParams,
            eos_ids: Iterable[int], generator: torch.Generator | None, runner: TargetRunner | None) -> Generation:
    """The one speculative loop (the module's five steps), for chains and trees alike: `proposer`
    is (the depth a step allows, propose(ctx, depth) -> (tree, confidences)), `verify` how the
    target's forward runs the tree and what its cache keeps (`_ChainVerify`, `_TreeVerify`)."""
    eos = frozenset(eos_ids)
    runner = runner or TargetRunner(model, drafter.hidden_state_layers)
    max_depth, propose = proposer
    clock = time.perf_counter
    start = clock()
    gen, ctx, token = _prefill(runner, drafter, prompt_ids, sampling, generator)
    observe_verify = getattr(drafter, "observe_verify", None)  # a drafter that prices its steps by verify time
    done = token in eos
    while not done and len(gen.tokens) < max_new_tokens:
        # 1. draft: never deeper than can still be emitted (the target adds one token itself)
        depth = min(max_depth, max_new_tokens - len(gen.tokens) - 1)
        t0 = clock()
        tree, confidences = propose(ctx, depth)
        runner._sync()
        t1 = clock()
        # 2. one target forward over the pending token and every draft
        committed = runner.length
        logits, hidden = verify.forward(runner, token, tree, committed)
        runner._sync()
        t2 = clock()
        # 3. the accepted path and the next token
        path, token = accept(tree, verify.chain, logits, sampling, generator)
        # 4. roll back the target cache and the drafter to the accepted path
        verify.keep(runner, committed, path, len(tree))
        t3 = clock()
        drafter.accept(len(path))
        t4 = clock()
        if observe_verify:
            observe_verify(len(tree) + 1, t2 - t1)
        # 5. emit
        new, done = _truncate_at_eos([tree.tokens[i] for i in path] + [token], eos)
        gen.tokens += new
        ctx.token_ids += new
        if hidden:
            ctx.hidden_states = verify.hidden(hidden, path)
        gen.add_step(depth, len(tree), len(path), (t1 - t0) + (t4 - t3), t2 - t1)
        if confidences is not None:
            gen.confidences.append(confidences)
    return _finished(gen, max_new_tokens, eos, clock() - start)


def generate_speculative(model, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int,
                         num_draft_tokens: int, sampling: SamplingParams = GREEDY,
                         eos_ids: Iterable[int] = (), generator: torch.Generator | None = None,
                         runner: TargetRunner | None = None) -> Generation:
    """Chain speculative decoding; greedy output equals `generate_plain`'s token for
    token, sampled output has the target's distribution."""
    return _decode(model, drafter, prompt_ids, max_new_tokens, _chain_proposer(drafter, num_draft_tokens),
                   _ChainVerify, sampling, eos_ids, generator, runner)


def generate_tree(model, drafter, prompt_ids: list[int], max_new_tokens: int, shape: TreeShape,
                  sampling: SamplingParams = GREEDY, eos_ids: Iterable[int] = (),
                  generator: torch.Generator | None = None, runner: TargetRunner | None = None) -> Generation:
    """Tree speculative decoding (`decoding/tree.py`): the drafter's `propose_tree` gives up to
    `shape.nodes` nodes, one target forward verifies them all under the tree mask, the
    longest accepted root path and the target's next token are emitted, and the cache keeps
    only that path (`runner.keep_rows`). Greedy output equals `generate_plain`'s; sampled
    output has the target's law. Per step, draft_lengths counts the nodes verified and
    draft_limits the depth allowed."""
    return _decode(model, drafter, prompt_ids, max_new_tokens, _tree_proposer(drafter, shape), _TreeVerify,
                   sampling, eos_ids, generator, runner)


def tree_decoding(model, drafter, mixed: bool, cfg, sampling: SamplingParams, eos_ids, gen_for, target):
    """The evaluate stage's decode(ids, max_new_tokens, seed) of a tree method: `eval.tree`'s
    trees from its chain method's drafter (mixed: with n-gram lookup's match beside them),
    verified on `target`'s forward (a `runtime.target_choice.TargetForward`)."""
    if not can_branch(drafter):
        raise RuntimeError(f"{drafter.name} cannot branch: its drafter has no propose_tree")
    if mixed:
        drafter = MixedTreeDrafter(drafter, build_ngram(cfg, model))
    shape = TreeShape(cfg.eval.tree.depth, cfg.eval.tree.branch, cfg.eval.tree.nodes)
    runner = target.runner(drafter.hidden_state_layers)

    def decode(ids, n, seed):
        return generate_tree(model, drafter, ids, n, shape, sampling, eos_ids, gen_for(seed), runner)
    return decode
