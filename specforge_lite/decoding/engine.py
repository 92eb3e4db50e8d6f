"""Decoding loops over a Hugging Face causal LM with a KV cache (batch 1).

`generate_plain` is the baseline: one target forward per token.
`generate_speculative` is chain speculative decoding with any `Drafter`:

1. the drafter proposes up to k tokens after the committed tokens;
2. one target forward runs over the pending token and the k drafts, extending the
   target's KV cache (the committed prefix is never recomputed);
3. the acceptance rule (`verify.py`) keeps a prefix of the drafts and picks the
   next token (the correction, or the bonus token when all k were kept);
4. the target's KV cache is cropped to drop the rejected drafts, and the drafter
   is told how many it got right so it can roll back its own state (and, where it
   has `observe_verify`, the width and measured seconds of that verify forward);
5. the kept drafts and the next token are emitted; stop on EOS or max_new_tokens.

`generate_tree` is the same loop over a draft tree (`tree.py`): the drafter's `propose_tree`,
one verify forward of every node under the tree mask, the longest accepted root path, and
a cache compacted to that path (`runner.keep_rows`).

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
from specforge_lite.decoding.tree import TreeShape, greedy_accept, path_rows, sample_accept, verify_layout
from specforge_lite.decoding.verify import (GREEDY, SamplingParams, greedy_verify, pick_tokens,
                                            rejection_verify, warp_probs)


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


@torch.inference_mode()
def generate_speculative(model, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int,
                         num_draft_tokens: int, sampling: SamplingParams = GREEDY,
                         eos_ids: Iterable[int] = (), generator: torch.Generator | None = None,
                         runner: TargetRunner | None = None) -> Generation:
    """Chain speculative decoding; greedy output equals `generate_plain`'s token for
    token, sampled output has the target's distribution."""
    eos = frozenset(eos_ids)
    runner = runner or TargetRunner(model, drafter.hidden_state_layers)
    clock = time.perf_counter
    start = clock()
    gen, ctx, token = _prefill(runner, drafter, prompt_ids, sampling, generator)
    observe_verify = getattr(drafter, "observe_verify", None)  # a drafter that prices its steps by verify time
    done = token in eos
    while not done and len(gen.tokens) < max_new_tokens:
        # 1. draft: never more than can still be emitted (the target adds one token itself)
        k = min(num_draft_tokens, max_new_tokens - len(gen.tokens) - 1)
        t0 = clock()
        proposal = drafter.propose(ctx, k)  # also at k = 0, so a drafter sees every committed position
        draft = proposal.tokens[:k]
        runner._sync()
        t1 = clock()
        # 2. one target forward over the pending token and the drafts
        committed = runner.length
        logits, hidden = runner.forward([token] + draft)
        runner._sync()
        t2 = clock()
        # 3. accept a prefix of the drafts, pick the next token
        if sampling.greedy:
            accepted, token = greedy_verify(draft, logits)
        else:
            q = proposal.probs[:len(draft)] if proposal.probs is not None else None
            accepted, token = rejection_verify(draft, q, warp_probs(logits, sampling), generator)
        # 4. roll back the target cache and the drafter to the accepted prefix
        if accepted < len(draft):
            runner.crop(committed + 1 + accepted)
        t3 = clock()
        drafter.accept(accepted)
        t4 = clock()
        if observe_verify:
            observe_verify(len(draft) + 1, t2 - t1)
        # 5. emit
        new, done = _truncate_at_eos(draft[:accepted] + [token], eos)
        gen.tokens += new
        ctx.token_ids += new
        if hidden:
            ctx.hidden_states = {layer: h[:, :accepted + 1] for layer, h in hidden.items()}
        gen.add_step(k, len(draft), accepted, (t1 - t0) + (t4 - t3), t2 - t1)
        gen.confidences.append(list(proposal.confidence or [])[:len(draft)])
    return _finished(gen, max_new_tokens, eos, clock() - start)


@torch.inference_mode()
def generate_tree(model, drafter, prompt_ids: list[int], max_new_tokens: int, shape: TreeShape,
                  sampling: SamplingParams = GREEDY, eos_ids: Iterable[int] = (),
                  generator: torch.Generator | None = None, runner: TargetRunner | None = None) -> Generation:
    """Tree speculative decoding (`decoding/tree.py`): the drafter's `propose_tree` gives up to
    `shape.nodes` nodes, one target forward verifies them all under the tree mask, the
    longest accepted root path and the target's next token are emitted, and the cache keeps
    only that path (`runner.keep_rows`). Greedy output equals `generate_plain`'s; sampled
    output has the target's law. Per step, draft_lengths counts the nodes verified and
    draft_limits the depth allowed."""
    eos = frozenset(eos_ids)
    runner = runner or TargetRunner(model, drafter.hidden_state_layers)
    clock = time.perf_counter
    start = clock()
    gen, ctx, token = _prefill(runner, drafter, prompt_ids, sampling, generator)
    observe_verify = getattr(drafter, "observe_verify", None)  # a drafter that prices its steps by verify time
    done = token in eos
    while not done and len(gen.tokens) < max_new_tokens:
        # 1. draft a tree no deeper than what can still be emitted (depth 0: an empty tree)
        depth = min(shape.depth, max_new_tokens - len(gen.tokens) - 1)
        t0 = clock()
        tree = drafter.propose_tree(ctx, depth, shape.branch, shape.nodes)
        if len(tree) > shape.nodes or (len(tree) and max(tree.depths()) > depth):
            raise RuntimeError(f"{drafter.name} proposed {len(tree)} nodes of depth up to {max(tree.depths())}; "
                               f"the step allowed {shape.nodes} nodes of depth {depth}")
        runner._sync()
        t1 = clock()
        # 2. one target forward over the root (the pending token) and every node
        committed = runner.length
        positions, mask = verify_layout(tree, committed)
        logits, hidden = runner.forward_tree([token] + tree.tokens, positions, mask)
        runner._sync()
        t2 = clock()
        # 3. the longest accepted root path and the next token
        if sampling.greedy:
            path, token = greedy_accept(tree, logits)
        else:
            path, token = sample_accept(tree, warp_probs(logits, sampling), generator)
        # 4. the cache keeps the root and the path, moved down to contiguous slots
        rows = path_rows(path)
        runner.keep_rows(committed, rows)
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
            index = torch.tensor(rows, device=next(iter(hidden.values())).device)
            ctx.hidden_states = {layer: h.index_select(1, index) for layer, h in hidden.items()}
        gen.add_step(depth, len(tree), len(path), (t1 - t0) + (t4 - t3), t2 - t1)
    return _finished(gen, max_new_tokens, eos, clock() - start)


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
