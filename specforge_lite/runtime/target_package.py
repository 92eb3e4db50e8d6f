"""The target's forward as AOTInductor packages (`FastEngine`'s compiled graphs on a CPU): the
chain forward for widths 1..max_width (`packaged_forward`) and a draft tree's verify at one width
(`TreeVerify`, `packaged_tree_forward`), each exported with the window's length dynamic and kept in
the graph cache under a key of everything it is built from (`graph_key`)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from specforge_lite.runtime import graph_cache
from specforge_lite.runtime.static_llama import WINDOW_STEP, StaticLlama

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
