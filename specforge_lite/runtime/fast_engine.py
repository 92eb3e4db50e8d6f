"""The static target forward: `FastEngine` (a `StaticLlama`, eager or compiled); the chooser
among it and Hugging Face's forward is `target_choice.build_target_engine`.

`FastEngine` owns one `StaticLlama` for a run and, when compiled, a graph for the
decoding widths 1..max_width. On a CPU that is one AOTInductor package (`torch.export`
with the width and the window dynamic, inductor with frozen, pre-packed weights and
autotuned products), kept on disk under a key of everything it was built from (weights,
shapes, torch, CPU capability, threads, these files), so a later run with the same target
loads it instead of compiling (`graph_cache.graph_cache_dir`). On a GPU it is
`torch.compile` graphs per width with CUDA graphs, built each run. Wider forwards (prefill)
run the same module eagerly. With a node budget (`tree_width` = nodes + 1) it also keeps one
tree-verify graph of that width (`TreeVerify`, built the same way): every draft tree's verify
forward runs it, padded to the width. (`torch.compile`'s own graph cache skips graphs whose frozen
weights were packed for oneDNN, and without that packing its C++ GEMM template is not used:
hence the package.)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

import torch

from specforge_lite.runtime import graph_cache
from specforge_lite.runtime.compile import compile_frozen
from specforge_lite.runtime.static_llama import WINDOW_STEP, StaticLlama
from specforge_lite.runtime.width_timing import MIN_MARGIN, time_forwards
from specforge_lite.runtime.target_package import (PACKAGE_WIDTHS, TreeVerify, _tree_example, packaged_forward,
                                                   packaged_tree_forward)

log = logging.getLogger(__name__)

ENGINES = ("auto", "compiled", "static", "hf")

# the eager module serves a width only where it beats the graph by more than this share: the
# least lead that changes a default (`width_timing`)
EAGER_MARGIN = MIN_MARGIN


class FastEngine:
    """One `StaticLlama` for a run, shared by every method's runner (one decode at a time).

    compiled: forwards of the widths the graphs cover run them (built or loaded by `compile()`,
    before anything is timed; a package covers 1..max(max_width, PACKAGE_WIDTHS)), but for the
    widths `route_widths` measured the eager module faster at; other widths run the module
    eagerly. On a CPU
    the graphs are one AOTInductor package kept in `cache_dir` (default `graph_cache_dir()`;
    None keeps none); on a GPU, `torch.compile` graphs with CUDA graphs (`packaged=False`
    asks for those on a CPU too: one per width, built each run).
    tree_width: the node budget + 1 of the tree methods; when compiled, one `TreeVerify`
    graph of that width (built the same way) runs every tree's verify forward, padded to it
    (0: trees run the module eagerly).
    """

    def __init__(self, model, capacity: int, hidden_layers: Iterable[int] = (), max_width: int = 1,
                 compiled: bool = False, cache_dir: Path | None | str = "default", packaged: bool | None = None,
                 tree_width: int = 0):
        self.model = model
        self.num_states = model.config.num_hidden_layers + 1  # embeddings + every layer's output
        self.module = StaticLlama(model, capacity, sorted({layer % self.num_states for layer in hidden_layers})).eval()
        self.device = self.module.lm_head.device
        self.max_width = max_width
        self.compiled = compiled
        self.compile_s: float | None = None
        self.cache_dir = graph_cache.resolve_cache_dir(cache_dir)
        self.graph_source: str | None = None  # "compiled" or "loaded" (from cache_dir)
        self.packaged = self.device.type == "cpu" if packaged is None else packaged
        self._graph = None
        self.tree_width = tree_width
        self._tree_graph = None
        self.tree_graph_source: str | None = None
        self.length = 0
        self.owner = None  # the runner whose state the cache holds
        self.eager_widths: set[int] = set()  # widths the graph covers that the module serves faster (`route_widths`)

    @property
    def capacity(self) -> int:
        return self.module.capacity

    @property
    def graph_widths(self) -> int:
        """The widest forward the compiled graph covers (0 before `compile`): a package covers
        1..max(max_width, PACKAGE_WIDTHS), per-width graphs 1..max_width."""
        if self._graph is None:
            return 0
        return max(self.max_width, PACKAGE_WIDTHS) if self.packaged else self.max_width

    def serves(self, width: int) -> str:
        """Which forward runs a chain forward of `width` tokens: "compiled" or "eager"."""
        return "compiled" if width <= self.graph_widths and width not in self.eager_widths else "eager"

    @torch.inference_mode()
    def route_widths(self, widths: Iterable[int], context_len: int = 64, rounds: int = 3) -> dict:
        """Time the compiled graph and the eager module at each of `widths` the graph covers, after a
        `context_len`-token context, in interleaved rounds (`width_timing.time_forwards`), and let the
        eager module serve the widths where it is faster by more than EAGER_MARGIN. Returns
        {"ms": {forward: {width: median ms}}, "serves": {width: forward}} for the report; the cache
        holds nothing committed afterwards."""
        widths = sorted({w for w in widths if 1 <= w <= self.graph_widths and context_len + w <= self.capacity})
        self.eager_widths = set()
        if not widths:
            return {"ms": {}, "serves": {}}
        context = torch.randint(0, self.model.config.vocab_size, (context_len,),
                                generator=torch.Generator().manual_seed(0)).tolist()
        runners = {"compiled": _Forced(self, set()), "eager": _Forced(self, set(widths))}
        ms = time_forwards(runners, context, widths, rounds)["ms"]
        self.length = 0
        self.eager_widths = {w for w in widths if ms["eager"][w] * (1 + EAGER_MARGIN) < ms["compiled"][w]}
        if self.eager_widths:
            log.info("the eager forward serves widths %s (faster there than the compiled graph)",
                     sorted(self.eager_widths))
        return {"ms": ms, "serves": {w: self.serves(w) for w in widths}}

    def compile(self) -> float:
        """Build (or load) the graphs of widths 1..max_width now; returns the seconds it took."""
        if not self.compiled or self._graph is not None:
            return self.compile_s or 0.0
        if self.packaged:
            graph, self.compile_s, self.graph_source = packaged_forward(self.module, self.max_width, self.cache_dir)
        else:
            with torch.inference_mode():
                widths = [(torch.zeros(w, dtype=torch.long, device=self.device), torch.arange(w, device=self.device),
                           None, False, self.module.window(WINDOW_STEP)) for w in range(1, self.max_width + 1)]
            graph, self.compile_s = compile_frozen(self.module, widths, dynamic_args=(4,))
            self.graph_source = "compiled"
        self._graph = graph
        self.length = 0
        widths = max(self.max_width, PACKAGE_WIDTHS) if self.packaged else self.max_width
        log.info("%s the target's forward for widths 1..%d in %.0f s", self.graph_source, widths, self.compile_s)
        if self.tree_width:
            self._compile_tree()
        return self.compile_s

    def _compile_tree(self) -> None:
        width = self.tree_width
        if self.packaged:
            graph, seconds, self.tree_graph_source = packaged_tree_forward(self.module, width, self.cache_dir)
        else:
            with torch.inference_mode():
                example = _tree_example(self.module, width)
            graph, seconds = compile_frozen(TreeVerify(self.module), [example], dynamic_args=(2,))
            self.tree_graph_source = "compiled"
        self._tree_graph = graph
        self.compile_s += seconds
        log.info("%s the target's tree-verify forward of width %d in %.0f s", self.tree_graph_source, width, seconds)

    def runner(self, layers: Iterable[int] = ()) -> "FastRunner":
        return FastRunner(self, tuple(layers))

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        width = len(token_ids)
        start = self.length
        if start + width > self.capacity:
            raise RuntimeError(f"the static KV cache holds {self.capacity} positions; this forward needs "
                               f"{start + width} (raise the engine's capacity)")
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + width, device=self.device)
        use_graph = self.serves(width) == "compiled"
        window = self.module.window(start + width)
        logits, hidden = (self._graph if use_graph else self.module)(ids, positions, None, False, window)
        self.length = start + width
        return logits, hidden


    @torch.inference_mode()
    def forward_tree(self, token_ids: list[int], positions: torch.Tensor, mask: torch.Tensor
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A draft tree's verify forward (`hf_runner.TargetRunner.forward_tree`): its rows go
        to slots length .. length + t - 1, rotary at `positions`, attending where `mask`
        [t, length + t] says. The compiled graphs run it where they can: a chain-shaped
        layout (an empty tree, a one-branch tree) as the chain forward of its width, any other
        tree of at most tree_width rows that sees the whole context the tree-verify graph;
        else the module runs it eagerly."""
        width, start = len(token_ids), self.length
        if start + width > self.capacity:
            raise RuntimeError(f"the static KV cache holds {self.capacity} positions; this forward needs "
                               f"{start + width} (raise the engine's capacity)")
        positions, mask = positions.cpu(), mask.cpu()  # verify_layout builds them on the CPU: no device sync
        rows = mask[:, start:start + width]
        if self.serves(width) == "compiled" and _chain_shaped(positions, rows, start):
            return self.forward(token_ids)
        if (self._tree_graph is not None and width <= self.tree_width and start + self.tree_width <= self.capacity
                and bool(mask[:, :start].all())):
            logits, hidden = self._verify_padded(token_ids, positions, rows, start)
            self.length = start + width
            return logits, hidden
        window = self.module.window(start + width)
        visible = torch.zeros(width, window.shape[0], dtype=torch.bool, device=self.device)
        visible[:, :start + width] = mask.to(self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        slots = torch.arange(start, start + width, device=self.device)
        logits, hidden = self.module(ids, positions.to(self.device), None, False, window, None, slots, visible)
        self.length = start + width
        return logits, hidden

    def _verify_padded(self, token_ids: list[int], positions: torch.Tensor, rows: torch.Tensor, start: int
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tree-verify graph over the t rows padded to tree_width: padding rows (token 0 at
        the root's position) see only themselves and write slots past the tree's, which the
        cache never counts as committed; their outputs are cut off."""
        width, full = len(token_ids), self.tree_width
        padded = torch.zeros(full, full, dtype=torch.bool)
        padded[:width, :width] = rows
        padded.diagonal()[width:] = True
        ids = torch.tensor(token_ids + [0] * (full - width), dtype=torch.long)
        positions = torch.cat([positions, positions.new_full((full - width,), start)])
        device = self.device
        write_at = torch.arange(start, start + full, device=device)
        logits, hidden = self._tree_graph(ids.to(device), positions.to(device), self.module.window(start + full),
                                          write_at, padded.to(device))
        return logits[:width], [h[:width] for h in hidden]

    def keep_rows(self, base: int, rows: list[int]) -> None:
        """Keep rows `rows` (increasing, rows[0] = 0) of the tree forward that began at slot
        `base`, moved down to slots base .., as the committed positions (the same whichever
        forward wrote them: every one writes row r at slot base + r)."""
        source = [base + r for r in rows]
        if source != list(range(base, base + len(rows))):
            index = torch.tensor(source, device=self.device)
            for layer in self.module.layers:
                for cache in (layer.k_cache, layer.v_cache):
                    cache[:, :, base:base + len(rows)] = cache.index_select(2, index)
        self.length = base + len(rows)


def _chain_shaped(positions: torch.Tensor, rows: torch.Tensor, start: int) -> bool:
    """Whether a verify layout is a chain's: positions start, start + 1, .. and a causal mask."""
    width = rows.shape[0]
    return (torch.equal(positions, torch.arange(start, start + width))
            and torch.equal(rows, torch.ones(width, width, dtype=torch.bool).tril()))


class _Forced:
    """A runner over the engine's shared cache whose every forward runs one way: the eager module at
    `eager` widths, the graph (where it covers the width) at the others (`FastEngine.route_widths`)."""

    def __init__(self, engine: FastEngine, eager: set[int]):
        self.engine, self.eager = engine, eager
        self._sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)

    def reset(self) -> None:
        self.engine.length = 0

    def forward(self, token_ids: list[int], last_only: bool = False):
        self.engine.eager_widths = self.eager
        return self.engine.forward(token_ids)

    def crop(self, keep: int) -> None:
        self.engine.length = min(self.engine.length, keep)


class FastRunner:
    """`engine.TargetRunner`'s interface over a `FastEngine`: extends the shared cache."""

    def __init__(self, engine: FastEngine, layers: tuple[int, ...]):
        built = engine.module.hidden_layers
        missing = [layer for layer in layers if layer % engine.num_states not in built]
        if missing:
            raise ValueError(f"the engine was built without hidden layers {missing}")
        self.engine = engine
        self.model = engine.model
        self.device = engine.device
        self.layers = layers  # as the drafter asked (negative ones count from the end)
        self._index = [built.index(layer % engine.num_states) for layer in layers]
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

    def reset(self) -> None:
        self.engine.length = 0
        self.engine.owner = self

    @property
    def length(self) -> int:
        return self.engine.length

    def forward(self, token_ids: list[int], last_only: bool = False
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if self.engine.owner is not self:
            raise RuntimeError("another runner used the shared cache since this one's reset()")
        logits, hidden = self.engine.forward(token_ids)
        if last_only:
            logits = logits[-1:]
        return logits, {layer: hidden[i][None] for layer, i in zip(self.layers, self._index)}

    def crop(self, keep: int) -> None:
        self.engine.length = min(self.engine.length, keep)

    def forward_tree(self, token_ids: list[int], positions: torch.Tensor, mask: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if self.engine.owner is not self:
            raise RuntimeError("another runner used the shared cache since this one's reset()")
        logits, hidden = self.engine.forward_tree(token_ids, positions, mask)
        return logits, {layer: hidden[i][None] for layer, i in zip(self.layers, self._index)}

    def keep_rows(self, base: int, rows: list[int]) -> None:
        self.engine.keep_rows(base, rows)
