"""The folder of compiled graphs kept between runs: keys, eviction, state passed as inputs."""

from __future__ import annotations

import os

import torch

from specforge_lite.runtime import graph_cache


def test_older_packages_of_a_label_are_evicted_first(tmp_path):
    # KEEP_PER_LABEL per label, the least recently used (mtime: a load touches it) removed;
    # other labels and the package just written are left alone
    keep = graph_cache.KEEP_PER_LABEL
    names = [f"eagle3-chain-{i:02d}.pt2" for i in range(keep + 2)]
    for age, name in enumerate(names):  # names[0] the newest
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1e9 - age * 100, 1e9 - age * 100))
    (tmp_path / "target-00.pt2").write_bytes(b"x")
    os.utime(tmp_path / "target-00.pt2", (1, 1))  # oldest of all, but another label
    written = tmp_path / names[-1]  # the oldest mtime, yet the one this run wrote
    graph_cache._evict(tmp_path, "eagle3-chain", written)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([*names[:keep - 1], names[-1], "target-00.pt2"])


def test_a_process_never_evicts_the_packages_it_uses(tmp_path, monkeypatch):
    """An evaluate of more drafters of one kind than KEEP_PER_LABEL keeps every graph it used
    (it loads them all again next run); only packages it did not use make room."""
    keep = graph_cache.KEEP_PER_LABEL
    monkeypatch.setattr(graph_cache, "_IN_USE", set())
    used = [tmp_path / f"dflash-chain-used{i}.pt2" for i in range(keep + 1)]
    stale = [tmp_path / f"dflash-chain-stale{i}.pt2" for i in range(2)]
    for age, path in enumerate(used + stale):  # the used ones are the oldest on disk
        path.write_bytes(b"x")
        os.utime(path, (1e9 + age * 100, 1e9 + age * 100))
    graph_cache._IN_USE.update(used[:-1])
    graph_cache._evict(tmp_path, "dflash-chain", used[-1])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in used)
    # with fewer in use, the newest unused ones fill the room left
    graph_cache._IN_USE.clear()
    for path in stale:
        path.write_bytes(b"x")
        os.utime(path, (2e9, 2e9))
    graph_cache._evict(tmp_path, "dflash-chain", used[0])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == keep and used[0].name in left and all(p.name in left for p in stale)


def test_key_follows_weights_facts_and_threads():
    w = torch.arange(6, dtype=torch.float32)
    base = graph_cache.graph_key({"a": 1}, [("w", w)], [graph_cache.__file__])
    assert graph_cache.graph_key({"a": 1}, [("w", w.clone())], [graph_cache.__file__]) == base
    assert graph_cache.graph_key({"a": 2}, [("w", w)], [graph_cache.__file__]) != base
    changed = w.clone()
    changed[5] += 1e-6
    assert graph_cache.graph_key({"a": 1}, [("w", changed)], [graph_cache.__file__]) != base
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert graph_cache.graph_key({"a": 1}, [("w", w)], [graph_cache.__file__]) != base
    finally:
        torch.set_num_threads(threads)


class _Cached(torch.nn.Module):
    """A product whose result is also written into a cache buffer at `positions`."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(16, 8), persistent=False)

    def forward(self, x, positions):
        y = self.proj(x)
        self.cache.index_copy_(0, positions, y)
        return y.sum(0), self.cache.sum(0)


def test_kept_graph_writes_the_current_cache_and_loads_in_a_later_run(tmp_path):
    from torch.export import Dim

    torch.manual_seed(0)
    module = _Cached().eval()
    calls = [(torch.zeros(n, 8), torch.arange(n)) for n in (1, 2, 3)]
    rows = Dim("rows", min=1, max=3)
    built = [graph_cache.compile_kept("toy", module, calls, state=("cache",), dynamic_shapes=({0: rows}, {0: rows}),
                                      example=calls[1], cache_dir=tmp_path) for _ in range(2)]
    assert [how for _, _, how in built] == ["compiled", "loaded"]
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == ["toy"]
    eager_cache = torch.zeros(16, 8)
    for graph, _, _ in built:
        module.cache = torch.zeros(16, 8)  # a new cache tensor (as a grown one): the graph writes it
        eager = _Cached().eval()
        eager.load_state_dict(module.state_dict())
        eager.cache = eager_cache.zero_()
        for n, start in ((3, 0), (1, 3), (2, 4)):
            x, positions = torch.randn(n, 8), torch.arange(start, start + n)
            with torch.inference_mode():
                got, want = graph(x, positions), eager(x, positions)
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(module.cache, eager.cache)
        assert module.cache[:6].abs().sum() > 0 and module.cache[6:].abs().sum() == 0


def test_the_isa_probe_is_kept_in_inductors_lasting_cache_and_the_build_in_a_scratch_one(tmp_path, monkeypatch):
    """Inductor's CPU ISA probe (a small library built per ISA) lands in its lasting cache, where a
    later process finds it; the package itself is built in a scratch cache, removed afterwards."""
    import torch._inductor
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    seen = {}
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: seen.setdefault("probe", cache_dir()))

    def build(program, package_path, inductor_configs):
        seen["build"] = cache_dir()
        open(package_path, "wb").close()

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", build)
    graph_cache._build(lambda: None, tmp_path / "toy.pt2")
    assert (tmp_path / "toy.pt2").is_file()
    assert seen["probe"] == cache_dir() and seen["build"] != cache_dir() and not os.path.exists(seen["build"])
