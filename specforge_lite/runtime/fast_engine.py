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
from typing import Callable, Iterable

import torch
import torch.nn as nn

from specforge_lite.runtime import graph_cache
from specforge_lite.runtime.compile import compile_frozen
from specforge_lite.runtime.static_llama import WINDOW_STEP, StaticLlama

log = logging.getLogger(__name__)

ENGINES = ("auto", "compiled", "static", "hf")

# a package serves widths 1..max(this, the engine's max_width): its width is a dynamic size (as
# fast as per-width graphs: docs/BENCHMARKS.md engine_avx2), so evaluations at other k load it
PACKAGE_WIDTHS = 16


class _Exported(nn.Module):
    """`StaticLlama.forward` with the KV caches as inputs (graphs write them in place), the
    shape torch.export wants: a package then holds the weights but not the cache, which the
    engine keeps and every width shares."""

    def __init__(self, module: StaticLlama):
        super().__init__()
        self.module = module

    def forward(self, ids, positions, window, *caches):
        return self.module(ids, positions, None, False, window, caches)


class TreeVerify(nn.Module):
    """A draft tree's verify forward at one width W (the node budget + 1), as a graph takes it:
    ids [W], rotary positions [W], the window, write_at [W] = the slots committed ..
    committed + W - 1, and rows [W, W] bool, the tree's own mask (row r sees row r' where
    True; `decoding/tree.verify_layout`'s last W columns). Every row also sees the committed
    slots (those before write_at[0]) and none past the forward's own. Padding rows (a smaller
    tree) see only themselves. Returns the module's (logits [W, V], hidden states [W, H])."""

    def __init__(self, module: StaticLlama):
        super().__init__()
        self.module = module

    def forward(self, ids, positions, window, write_at, rows, *caches):
        width = rows.shape[0]
        offset = window - write_at[0]  # a slot's row in this forward; negative: committed context
        tree = rows[:, offset.clamp(0, width - 1)] & ((offset >= 0) & (offset < width))[None, :]
        visible = (offset < 0)[None, :] | tree
        return self.module(ids, positions, None, False, window, caches or None, write_at, visible)


def _caches(module: StaticLlama) -> list[torch.Tensor]:
    return [c for layer in module.layers for c in (layer.k_cache, layer.v_cache)]


def graph_key(module: StaticLlama, max_width: int, tree: bool = False) -> str:
    """A digest of everything a target package is built from: the weights and rotary tables
    (every byte), the shapes, the source of the files that build it, torch's version, the
    CPU capability inductor compiles for and the thread count its kernels are built for
    (`graph_cache.graph_key`). tree: the tree-verify package of width `max_width`."""
    facts = {"max_width": max_width, "tree": tree, "capacity": module.capacity, "batch": module.batch,
             "hidden_layers": list(module.hidden_layers), "window_step": WINDOW_STEP}
    tensors = [*module.named_parameters(), *[(n, b) for n, b in module.named_buffers() if n in ("cos", "sin")]]
    return graph_cache.graph_key(facts, tensors, graph_cache.RUNTIME_FILES)


def _export(module: StaticLlama, max_width: int):
    """The forward exported with width 1..max_width and the window length dynamic."""
    from torch.export import Dim, export

    device = module.lm_head.device
    width = min(2, max_width)
    ids = torch.zeros(width, dtype=torch.long, device=device)
    window = module.window(WINDOW_STEP)
    caches = tuple(c.clone() for c in _caches(module))  # not the buffers: export rejects aliased inputs
    width_dim = Dim("width", min=1, max=max_width) if max_width > 1 else None
    dims = ({0: width_dim} if width_dim else None, {0: width_dim} if width_dim else None,
            {0: Dim("window", min=2, max=module.capacity)}, (None,) * len(caches))
    with torch.no_grad():
        return export(_Exported(module), (ids, torch.arange(width, device=device), window, *caches),
                      dynamic_shapes=dims)


def _tree_example(module: StaticLlama, width: int) -> tuple:
    """TreeVerify's arguments for a tree of `width` rows at slot 0 (a chain: any mask serves)."""
    device = module.lm_head.device
    steps = torch.arange(width, device=device)
    rows = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return torch.zeros(width, dtype=torch.long, device=device), steps, module.window(width), steps.clone(), rows


def _export_tree(module: StaticLlama, width: int):
    """TreeVerify at `width` rows, exported with the window's length dynamic."""
    from torch.export import Dim, export

    caches = tuple(c.clone() for c in _caches(module))
    dims = (None, None, {0: Dim("window", min=2, max=module.capacity)}, None, None, (None,) * len(caches))
    with torch.no_grad():
        return export(TreeVerify(module), (*_tree_example(module, width), *caches), dynamic_shapes=dims)


def packaged_forward(module: StaticLlama, max_width: int, cache_dir: Path | None
                     ) -> tuple[Callable, float, str]:
    """The module's forward for widths 1..max_width (and up to PACKAGE_WIDTHS) as one
    AOTInductor package: loaded from `cache_dir` when a package built from the same weights,
    shapes and software is there, else compiled (and kept there unless `cache_dir` is None;
    `graph_cache.kept_package`).
    Returns (forward taking the module's arguments, seconds taken, "loaded" or "compiled")."""
    widths = max(max_width, PACKAGE_WIDTHS)
    runner, seconds, how = graph_cache.kept_package("target", graph_key(module, widths),
                                                    lambda: _export(module, widths), cache_dir)
    caches = _caches(module)

    def forward(ids, positions, start=None, last_only=False, window=None):
        if start is not None or last_only or window is None:
            raise ValueError("the packaged forward takes batch-1 ids, positions and a window")
        return runner(ids, positions, window, *caches)

    return forward, seconds, how


def packaged_tree_forward(module: StaticLlama, width: int, cache_dir: Path | None) -> tuple[Callable, float, str]:
    """`TreeVerify` of `width` rows as one AOTInductor package (kept and loaded as
    `packaged_forward`'s). Returns (forward taking TreeVerify's arguments without the caches,
    seconds taken, "loaded" or "compiled")."""
    runner, seconds, how = graph_cache.kept_package("target_tree", graph_key(module, width, tree=True),
                                                    lambda: _export_tree(module, width), cache_dir)
    caches = _caches(module)
    return (lambda *args: runner(*args, *caches)), seconds, how


class FastEngine:
    """One `StaticLlama` for a run, shared by every method's runner (one decode at a time).

    compiled: forwards of width 1..max_width run compiled graphs (built or loaded by
    `compile()`, before anything is timed); other widths run the module eagerly. On a CPU
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

    @property
    def capacity(self) -> int:
        return self.module.capacity

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
        use_graph = self._graph is not None and width <= self.max_width
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
        if self._graph is not None and width <= self.max_width and _chain_shaped(positions, rows, start):
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
