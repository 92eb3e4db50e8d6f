"""Compiled graphs kept between runs: AOTInductor packages keyed on everything they are built from.

Inductor's own graph cache skips the graphs decoding wants on a CPU (frozen weights packed for
oneDNN are not picklable), so every `torch.compile` of the target or a drafter would cost its
full compile on every run (compile times: docs/BENCHMARKS.md "Target forward" and "P-EAGLE
next to EAGLE-3"). Instead a graph is exported (`torch.export`, with chosen sizes
dynamic) and compiled by AOTInductor into one `.pt2` package, with frozen, pre-packed weights
and autotuned products, written atomically into `graph_cache_dir()` under a name
`<label>-<key>.pt2`; `key` is a digest of every weight byte, the example shapes, the dynamic
ranges, the plain attributes of the modules (a chain's number of drafts) and their source
files, torch's version, the CPU capability, the thread count, the GEMM rows and whether
products are autotuned. A later run with the same inputs loads it in seconds. A damaged or
foreign file is compiled again, and at most KEEP_PER_LABEL packages of one label are kept
(the least recently used go first), more where one process uses more of them at once (an
evaluate of several drafters of one kind): a process never evicts a package it has used.

State a graph writes in place (KV caches) is not in the package: `compile_kept` turns a
module's cache buffers into trailing inputs (`_StateInputs`), so the package holds the
weights and the caller passes the same cache tensors its eager path uses.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn

from specforge_lite.runtime.compile import _GemmRows, autotune, compile_frozen, gemm_rows

log = logging.getLogger(__name__)

GRAPH_FORMAT = 1  # bump when what a package holds changes shape
GRAPH_CACHE_ENV = "SPECFORGE_LITE_GRAPH_CACHE"
CACHE_ENV = "SPECFORGE_LITE_CACHE"  # its `compiled/` folder is the default
# packages of one label (the target, one drafter's chain, ...) kept in the folder: retraining a
# drafter or switching targets leaves older ones behind (a package holds the target's weights)
KEEP_PER_LABEL = 4
# the runtime files that shape every graph: a change to any of them rebuilds the packages
RUNTIME_FILES = tuple(Path(__file__).parent / name for name in
                      ("graph_cache.py", "compile.py", "static_llama.py", "fast_engine.py", "target_package.py"))


def graph_cache_dir() -> Path | None:
    """Where compiled graphs are kept between runs: $SPECFORGE_LITE_GRAPH_CACHE, else
    `compiled/` under the model cache ($SPECFORGE_LITE_CACHE); "0" (or "off") keeps none."""
    value = os.environ.get(GRAPH_CACHE_ENV, "").strip()
    if value.lower() in ("0", "off", "false", "none"):
        return None
    if value:
        return Path(value)
    from specforge_lite.targets.loading import cache_root

    return cache_root() / "compiled"


def resolve_cache_dir(cache_dir: Path | str | None) -> Path | None:
    """"default" is `graph_cache_dir()`; None or "" keeps nothing."""
    if cache_dir == "default":
        return graph_cache_dir()
    return Path(cache_dir) if cache_dir else None


def graph_key(facts: dict, tensors: Iterable[tuple[str, torch.Tensor]], files: Iterable[str | Path]) -> str:
    """A digest of `facts` (JSON-able), every byte of the named tensors and the source files,
    with what inductor compiles for on this machine (torch, CPU capability, threads, GEMM rows,
    autotuning)."""
    digest = hashlib.blake2b(digest_size=16)
    machine = {"format": GRAPH_FORMAT, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "gemm_rows": gemm_rows(), "autotune": autotune(), "cpu": torch.backends.cpu.get_cpu_capability()}
    digest.update(json.dumps({**facts, **machine}, sort_keys=True, default=str).encode())
    for file in sorted({str(f) for f in files}):
        digest.update(Path(file).read_bytes())
    for name, tensor in tensors:
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(data.shape)}:{data.dtype}".encode())
        if data.numel():
            digest.update(data.view(-1).view(torch.uint8).numpy())  # the buffer itself, not a copy
    return digest.hexdigest()


def source_files(module: nn.Module) -> set[str]:
    """The files defining `module`'s classes and its submodules', and the runtime files that
    shape every graph (`RUNTIME_FILES`)."""
    return {inspect.getfile(type(m)) for m in module.modules()} | {str(f) for f in RUNTIME_FILES}


PLAIN = (int, float, str, bool, type(None))


def module_facts(module: nn.Module) -> dict:
    """The plain attributes of `module` and its submodules (a chain's number of drafts, a
    head count): settings a graph bakes in that are neither weights nor input shapes."""
    facts = {}
    for name, sub in module.named_modules():
        plain = {}
        for key, value in vars(sub).items():
            if key.startswith("_") or key == "training":
                continue
            if isinstance(value, PLAIN):
                plain[key] = value
            elif isinstance(value, tuple) and all(isinstance(v, PLAIN) for v in value):
                plain[key] = list(value)
        if plain:
            facts[name or "."] = plain
    return facts


def example_facts(example: Sequence) -> list:
    return [(tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a) for a in example]


class _StateInputs(nn.Module):
    """`module`'s forward with the buffers named in `state` passed as trailing inputs
    (torch.export wants the state a graph writes in place as inputs; the package then holds
    the weights only, and callers pass the cache tensors the eager path shares)."""

    def __init__(self, module: nn.Module, state: Sequence[str]):
        super().__init__()
        self.module, self.state = module, tuple(state)

    def forward(self, *args):
        inputs, tensors = args[:len(args) - len(self.state)], args[len(args) - len(self.state):]
        return torch.func.functional_call(self.module, dict(zip(self.state, tensors)), inputs)


# the packages this process has loaded or written: its own eviction leaves them alone
_IN_USE: set[Path] = set()


def _evict(folder: Path, label: str, keep: Path) -> None:
    """Remove the least recently used packages of `label` beyond KEEP_PER_LABEL; never `keep`
    nor another package this process has used (they count towards the limit)."""
    used = {p for p in _IN_USE | {keep} if p.parent == folder and p.name.startswith(f"{label}-")}
    found = sorted((p for p in folder.glob(f"{label}-*.pt2") if p not in used),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    for old in found[max(0, KEEP_PER_LABEL - len(used)):]:
        try:
            old.unlink()
            log.info("removed the compiled graph %s (more than %d of %s kept)", old.name, KEEP_PER_LABEL, label)
        except OSError:
            pass


# temporary folders of a build in TMPDIR, named with the building process's id so that the next
# run removes those of a process that is gone (a compile killed mid-way leaves them otherwise)
BUILD_PREFIX, SCRATCH_PREFIX, PARTIAL_PREFIX = "specforge_lite_build_", "specforge_lite_graph_", ".partial-"
_LEFTOVER = re.compile(rf"(?:{BUILD_PREFIX}|{SCRATCH_PREFIX})(\d+)_")


def _gone(pid: int) -> bool:
    """True when no process `pid` runs (another user's live process counts as running)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def remove_leftovers(cache_dir: Path | None) -> None:
    """Remove the build folders (TMPDIR) and partial packages (`cache_dir`) of builds whose
    process is gone."""
    for entry in Path(tempfile.gettempdir()).glob("specforge_lite_*"):
        if (found := _LEFTOVER.match(entry.name)) and _gone(int(found.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            log.info("removed %s, left by an earlier compile that did not finish", entry)
    for entry in (cache_dir.glob(f"{PARTIAL_PREFIX}*") if cache_dir is not None and cache_dir.is_dir() else ()):
        pid = entry.name[len(PARTIAL_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and _gone(int(pid)):
            entry.unlink(missing_ok=True)


def _unkeepable(folder: Path, path: Path) -> str | None:
    """Why a package cannot be kept at `path` in `folder` (tried by creating a file there), or None."""
    if path.exists() and not path.is_file():
        return f"{path} is not a file"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f"{PARTIAL_PREFIX}{os.getpid()}-probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"{err.filename or folder}: {err.strerror or err}"
    return None


def _build(program_of: Callable[[], "torch.export.ExportedProgram"], path: Path) -> None:
    """Compile the exported program with AOTInductor into `path` (written whole or not at all)."""
    import torch._inductor
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    # inductor's probe of the CPU's vector ISA builds a small library per ISA, kept in its cache
    # and reused by later processes: probed here, in the lasting cache, not in the scratch one
    cpu_vec_isa.valid_vec_isa_list()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{PARTIAL_PREFIX}{os.getpid()}-{path.name}")  # AOTInductor wants the .pt2 suffix
    try:
        # built in a scratch inductor cache: the build leaves a copy of the whole shared library
        # (weights included) in inductor's cache, which the package makes redundant
        with torch.no_grad(), tempfile.TemporaryDirectory(prefix=f"{BUILD_PREFIX}{os.getpid()}_") as build, \
                temporary_cache_dir(build), _GemmRows(gemm_rows()):
            torch._inductor.aoti_compile_and_package(
                program_of(), package_path=str(partial),
                inductor_configs={"freezing": True, "max_autotune": autotune(), "autotune_num_choices_displayed": 0,
                                  "max_autotune_report_choices_stats": False})
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def kept_package(label: str, key: str, program_of: Callable[[], "torch.export.ExportedProgram"],
                 cache_dir: Path | None) -> tuple[Callable, float, str]:
    """The package `<label>-<key>.pt2` from `cache_dir` when it is there and loads, else
    compiled from `program_of()` (and kept there unless `cache_dir` is None).
    Returns (its runner, seconds taken, "loaded" or "compiled")."""
    import torch._inductor

    start = time.perf_counter()
    remove_leftovers(cache_dir)
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}_") as scratch:
        folder = cache_dir if cache_dir is not None else Path(scratch)
        path = folder / f"{label}-{key}.pt2"
        if path.is_file():
            try:
                runner = torch._inductor.aoti_load_package(str(path))
                if cache_dir is not None:
                    _IN_USE.add(path)
                try:
                    os.utime(path)  # recently used: evicted last
                except OSError:  # a read-only folder: still usable
                    pass
                return runner, time.perf_counter() - start, "loaded"
            except Exception as error:  # a damaged or foreign file: build it again
                log.warning("compiled graph %s did not load (%s: %s); compiling it again",
                            path, type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")
        if cache_dir is not None and (problem := _unkeepable(folder, path)):
            log.warning("cannot keep compiled graphs in %s (%s, or under %s): %s; the graph is compiled for "
                        "this run only", folder, GRAPH_CACHE_ENV, CACHE_ENV, problem)
            folder, cache_dir = Path(scratch), None
            path = folder / path.name
        _build(program_of, path)
        runner = torch._inductor.aoti_load_package(str(path))
        if cache_dir is not None:
            log.info("kept the compiled graph %s (%.0f MB)", path, path.stat().st_size / 1e6)
            _IN_USE.add(path)
            _evict(folder, label, path)
    return runner, time.perf_counter() - start, "compiled"


def compile_kept(label: str, module: nn.Module, example_calls: Sequence[tuple], state: Sequence[str] = (),
                 dynamic_shapes: tuple | None = None, example: tuple | None = None,
                 cache_dir: Path | str | None = "default", dynamic_args: Iterable[int] = ()
                 ) -> tuple[Callable, float, str]:
    """A drafter's graph for the calls in `example_calls`, built now.

    On a CPU: one AOTInductor package of `module` (exported at `example`, default the last
    call, with `dynamic_shapes` in torch.export's form for the call's own arguments), kept
    between runs (`kept_package`); the buffers named in `state` are passed at every call, so
    the graph writes the module's current cache tensors in place. Elsewhere (a GPU):
    `compile.compile_frozen` graphs, one per call (the first dimension of the arguments
    at `dynamic_args` dynamic), built every run.
    Returns (graph taking the call's arguments, seconds taken, "compiled" or "loaded")."""
    device = next(iter(module.parameters())).device
    if device.type != "cpu":
        graph, seconds = compile_frozen(module, example_calls, dynamic_args)
        return graph, seconds, "compiled"
    example = tuple(example if example is not None else example_calls[-1])
    wrapper = _StateInputs(module, state)
    # (owning submodule, buffer name) found once, not per call: get_buffer walks every dotted
    # name, and the sampler's step passes 60 caches per decoding step
    owners = [(module.get_submodule(parent), leaf) for parent, _, leaf in (n.rpartition(".") for n in state)]
    state_tensors = lambda: [owner._buffers[leaf] for owner, leaf in owners]  # noqa: E731
    buffers = [(n, b) for n, b in module.named_buffers() if n not in state]
    facts = {"label": label, "example": example_facts(example), "dynamic": repr(dynamic_shapes),
             "calls": [example_facts(call) for call in example_calls], "module": module_facts(module),
             "state": [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(state, state_tensors())]}
    key = graph_key(facts, [*module.named_parameters(), *buffers], source_files(module))

    def program():
        from torch.export import export

        args = (*[a.clone() if isinstance(a, torch.Tensor) else a for a in example],
                *[t.clone() for t in state_tensors()])  # not the buffers: export rejects aliased inputs
        # the wrapper's one parameter is *args: its shapes are one tuple, state static
        dims = None if dynamic_shapes is None else ((*dynamic_shapes, *(None,) * len(state)),)
        return export(wrapper, args, dynamic_shapes=dims)

    runner, seconds, how = kept_package(label, key, program, resolve_cache_dir(cache_dir))
    dtypes = [a.dtype if isinstance(a, torch.Tensor) else None for a in example]

    def graph(*args):
        # a package reads an input's bytes as the dtype it was built for: a bf16 tensor passed to a
        # float32 graph drafts garbage without an error, so a call in another dtype is refused
        for index, (arg, dtype) in enumerate(zip(args, dtypes)):
            if dtype is not None and arg.dtype != dtype:
                raise TypeError(f"compiled graph {label}: argument {index} is {arg.dtype}, the graph was built "
                                f"for {dtype}")
        return runner(*args, *state_tensors())

    return graph, seconds, how
