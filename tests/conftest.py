"""Shared fixtures: the repo's real Hydra configs, tiny targets, a CLI runner."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests import forked_cli, zygote

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "specforge_lite" / "conf"

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _session_folder(variable: str, prefix: str) -> None:
    """$variable names a folder of this session's, made (and removed at exit) by the first process
    to load this file; pytest-xdist's workers start from its environment and use the same one."""
    folder = tempfile.mkdtemp(prefix=prefix)
    if os.environ.setdefault(variable, folder) == folder:
        atexit.register(shutil.rmtree, folder, True)  # a SmolLM2 package holds all its weights
    else:
        os.rmdir(folder)


# compiled target graphs go to a folder of this session's (every run compiles afresh, and
# nothing is added to the user's cache); tests of the cache itself pass their own folders
_session_folder("SPECFORGE_LITE_GRAPH_CACHE", "specforge_lite_test_graphs_")
# what several test files make alike, made once for the session (`shared`)
SHARED_ENV = "SPECFORGE_LITE_TEST_SHARED"
_session_folder(SHARED_ENV, "specforge_lite_test_shared_")


# under pytest-xdist (`make test` runs TEST_WORKERS side by side) each worker, and every process
# it starts, gets its share of the cores: two workers of two torch threads each on two cores
# ran the numeric tests 3.4-5.2x slower than one process alone (threads spinning on one another)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
    if "torch" in sys.modules:  # imported before this file: its pool is already sized
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# compiled graphs here use inductor's default kernels: autotuning every product of the tiny test
# models costs minutes of compiling per test and checks inductor's kernels, not our graphs;
# `autotuned` (below) turns it back on for the tests about the autotuned kernels themselves
os.environ.setdefault("SPECFORGE_LITE_AUTOTUNE", "0")
# an AOTInductor package's host-side wrapper (argument checks, the calls into the kernels) built
# at -O0 instead of -O1: the kernels, whose numbers the tests check, keep their flags; every
# package builds faster (docs/TESTING.md); read when inductor's config loads, before any import of it
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")
# vLLM's n-gram proposer as the plain Python its numba functions are written in: the same proposals,
# without the JIT compile each TP worker of each vllm_ngram engine would pay at its first draft
# (docs/TESTING.md); read by numba when vLLM's processes import it
os.environ.setdefault("NUMBA_DISABLE_JIT", "1")


@pytest.fixture
def autotuned(monkeypatch):
    """Compiled graphs built in this test autotune their products, as users' do by default."""
    monkeypatch.setenv("SPECFORGE_LITE_AUTOTUNE", "1")


def compose(overrides: list[str] | None = None):
    """Compose the real config the CLI would see (`stage` defaults to sample)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from specforge_lite.drafters.registry import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return hydra_compose(config_name="config", overrides=overrides or [])


@pytest.fixture
def compose_cfg():
    return compose


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, check: bool = False, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    """Run `python -m specforge_lite ARGS` in a process of its own (tests/forked_cli.py: forked from
    a server that imported torch, transformers and hydra once), with `env` (default this one's)."""
    proc = forked_cli.run_cli(list(args), str(cwd or REPO), timeout, env)
    if check and proc.returncode != 0:
        raise AssertionError(f"CLI {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@contextlib.contextmanager
def shared(name: str):
    """The session's folder `name`, the same for every worker, held under a lock while in use: the
    first test to hold it makes what it holds, the later ones find it made."""
    import fcntl

    root = Path(os.environ[SHARED_ENV])
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield root / name


@pytest.fixture
def cli():
    return run_cli


def target_cfg(path: str, **extra):
    return OmegaConf.create({"path": path, "dtype": "float32", "device": "cpu", "chat_template": None,
                             "trust_remote_code": False, **extra})


@pytest.fixture(scope="session", autouse=True)
def _vllm_runner_server(request):
    """Where this session runs vLLM (tests marked `vllm` or `slow`): its runner forked from a server
    that imported vLLM once (tests/zygote.py); off with SPECFORGE_LITE_TEST_FRESH_PROCESS=1
    or a $SPECFORGE_LITE_VLLM_PYTHON of the caller's."""
    from specforge_lite.serving.vllm.interpreter import find_python

    wanted = any(item.get_closest_marker("vllm") or item.get_closest_marker("slow") for item in request.session.items)
    python = find_python() if wanted and os.environ.get(forked_cli.FRESH_ENV) != "1" \
        and not os.environ.get(zygote.ENV) else None
    if python is None:
        yield
        return
    folder = tempfile.mkdtemp(prefix="specforge_lite_vllm_")
    server = zygote.install_vllm(folder, python)
    try:
        yield
    finally:
        os.environ.pop(zygote.ENV, None)
        os.environ.pop(zygote.REAL_ENV, None)
        zygote.stop(server)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def rank_python(tmp_path_factory):
    """An interpreter for torchrun's `--no-python` ranks (`-m specforge_lite ...`): forked from a
    server that imported torch, transformers, hydra, accelerate and DeepSpeed once (tests/zygote.py);
    this interpreter itself with SPECFORGE_LITE_TEST_FRESH_PROCESS=1."""
    if os.environ.get(forked_cli.FRESH_ENV) == "1":
        yield sys.executable
        return
    shim, server = zygote.install(str(tmp_path_factory.mktemp("rank_python")), sys.executable, zygote.RANK_PRELOAD)
    try:
        yield shim
    finally:
        zygote.stop(server)


@pytest.fixture(scope="session")
def tiny_target():
    """(model, tokenizer) of the tiny random Llama built from the repo's config."""
    from specforge_lite.targets.loading import load_target

    return load_target(target_cfg("builtin:tiny-llama"))


@pytest.fixture(scope="session")
def two_layer_target(tiny_target):
    """A two-layer Llama of the tiny target's shape, its own seeded weights, for the compiled-forward
    tests whose rule does not depend on depth: a graph's code grows with the layers (docs/TESTING.md
    "Compiled forwards"). One model for the session, so its packages are shared through the cache."""
    import copy

    import torch

    config = copy.deepcopy(tiny_target[0].config)
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    return type(tiny_target[0])(config).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from specforge_lite.targets.loading import load_tokenizer

    return load_tokenizer(target_cfg("builtin:smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def smollm2_target():
    from specforge_lite.targets.loading import load_target

    return load_target(target_cfg("builtin:smollm2-135m-instruct"))


@pytest.fixture
def forbid_recompiles():
    """Call it once a test's graphs are built: from then on any dynamo recompile raises
    (a graph the first real call rebuilds runs unfrozen and untuned: slow, not wrong)."""
    import torch._dynamo.config as dynamo_config

    def forbid(on: bool = True) -> None:
        dynamo_config.error_on_recompile = on

    yield forbid
    dynamo_config.error_on_recompile = False


# the longest test files start first: `make test` hands whole files to its workers in collection
# order (--no-loadscope-reorder; pytest-xdist's own order puts the files with the most tests first,
# which left test_vllm.py, 3 tests and 328 s of a 1080 s suite, running alone at the end)
LONGEST_FIRST = ("integration/test_vllm.py", "integration/test_strategies.py")


def pytest_generate_tests(metafunc):
    """A test marked `fresh_cli` (exit codes, one-line errors: the door) runs twice, its commands
    forked from the warm server (or in this process) and in a fresh `python -m specforge_lite`
    (tests/forked_cli.py FRESH_ENV), so the suite checks what a user's own interpreter does."""
    if metafunc.definition.get_closest_marker("fresh_cli"):
        metafunc.fixturenames.append("interpreter")
        metafunc.parametrize("interpreter", ["warm", "fresh"], indirect=True)


@pytest.fixture
def interpreter(request, monkeypatch):
    """The interpreter a `fresh_cli` test's commands run in (see `pytest_generate_tests`)."""
    if request.param == "fresh":
        monkeypatch.setenv(forked_cli.FRESH_ENV, "1")
    return request.param


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order inside each file is kept


def tokens_2_3_law(target, prompt: list[int], sampling, vocab: int) -> Counter:
    """The exact joint law of generated tokens 2 and 3 (what the first speculative step emits)
    under the target's warped sampling, summed over token 1: the sampling-law tests' reference."""
    import torch

    from specforge_lite.decoding.verify import warp_probs

    def law(ctx):
        return warp_probs(target(torch.tensor([prompt + list(ctx)])).logits[0, -1], sampling)
    exact: Counter = Counter()
    with torch.no_grad():
        p1 = law(())
        for a in range(vocab):
            p2 = law((a,))
            for b in range(vocab):
                p3 = law((a, b))
                for c in range(vocab):
                    exact[(b, c)] += float(p1[a] * p2[b] * p3[c])
    return exact


def mostly_agree(same: list[bool], dtype) -> bool:
    """Whether a compiled drafting path agrees with its eager module over these calls: every one in
    float32; in bf16 at least three in four, since the two round differently and a near-tie may
    flip now and then, while a broken graph (one that drafts what the target never keeps)
    disagrees nearly always."""
    import torch

    return all(same) if dtype in (None, torch.float32, "float32") else 4 * sum(same) >= 3 * len(same)


def assert_same_law(counts, exact: dict, n: int) -> None:
    """Pearson's chi-square of `n` observed draws (`counts`) against the `exact` law, cells with an
    expected count below 5 pooled: fails at the 0.1% level (Wilson-Hilferty's critical value)."""
    import math

    small = [cell for cell, p in exact.items() if n * p < 5]
    observed = {cell: counts.get(cell, 0) for cell in exact if cell not in small}
    expected = {cell: n * exact[cell] for cell in observed}
    observed["pool"] = sum(counts.get(cell, 0) for cell in small)
    expected["pool"] = n * sum(exact[cell] for cell in small)
    stat = sum((observed[c] - expected[c]) ** 2 / expected[c] for c in observed if expected[c] > 0)
    df = len(observed) - 1
    critical = df * (1 - 2 / (9 * df) + 3.0902 * math.sqrt(2 / (9 * df))) ** 3
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (df {df})"


# a 7-token prompt, then what verifications commit (1..4 positions), then jumps a compiled graph
# does not take (the prompt of a longer turn), the last past a 64-slot cache
COMMITS = [7, 8, 10, 13, 17, 18, 21, 40, 44, 70, 73]


def as_evaluate_loads(kind: str, drafter, tiny_target, dtype, folder, cast: bool = True):
    """`drafter` (float32, as trained) saved to `folder` and loaded back the way evaluate loads it
    (`registry.engine_module`) for a copy of the tiny target in `dtype`: the module then runs in the
    target's dtype. cast=False: loaded as saved (float32) for that target, a drafter whose dtype
    differs from the features it reads."""
    import copy

    from specforge_lite.drafters.registry import DRAFTERS, engine_module

    DRAFTERS[kind].save(drafter, folder)
    target = copy.deepcopy(tiny_target[0]).to(dtype)
    return engine_module(kind, folder, target) if cast else DRAFTERS[kind].load(folder, target)


def drive_compiled_drafting(eager, compiled, loaded, k: int, layers: list[int], width: int,
                            other_k: int | None = None, dtype=None) -> list[tuple]:
    """Three decode drafters of one drafter (eager, compiled, loaded from the compiled one's
    package) fed the same random context call for call (`COMMITS`): calls 1, 2 and 5 sampled,
    whose draft distributions must agree; call 3 at `other_k` when given (eager vs compiled,
    tokens equal); the others greedy, returned as (eager, compiled, loaded) proposals. `dtype`: the
    target features' (the drafter's own), float32 by default; bf16 distributions agree within its rounding."""
    import torch

    from specforge_lite.contract import DraftContext
    from specforge_lite.decoding.verify import SamplingParams

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (100,), generator=gen).tolist()
    aux = torch.randn(1, 100, len(layers) * width, generator=gen).to(dtype or torch.float32)
    def same_law(p, q):  # bf16: a logit a few ulps off moves its probability by tens of percent, so
        p, q = p.float(), q.float()  # the rows are compared as laws (total variation), not entry by entry
        if aux.dtype == torch.float32:
            return torch.allclose(p, q, atol=1e-5)
        return bool((0.5 * (p - q).abs().sum(-1)).max() <= 0.1)

    greedy, lo = [], 0
    for call, hi in enumerate(COMMITS):
        hidden = {layer: aux[:, lo:hi, width * i: width * (i + 1)] for i, layer in enumerate(layers)}
        ctx = dict(token_ids=ids[: hi + 1], num_prompt_tokens=7, hidden_states=hidden)
        if call in (1, 2, 5):
            ctx["sampling"] = SamplingParams(0.8)
            a, b, c = (d.propose(DraftContext(**ctx, generator=torch.Generator().manual_seed(hi)), k)
                       for d in (eager, compiled, loaded))
            assert compiled.compiled_k == loaded.compiled_k == k
            assert same_law(a.probs, b.probs) and same_law(a.probs, c.probs)
        elif call == 3 and other_k is not None:  # another k: the same module, eagerly
            a, b, _ = (d.propose(DraftContext(**ctx), other_k).tokens for d in (eager, compiled, loaded))
            assert len(a) == len(b) == other_k and (a == b or aux.dtype != torch.float32)  # bf16: callers count
        else:
            greedy.append(tuple(d.propose(DraftContext(**ctx), k).tokens for d in (eager, compiled, loaded)))
        lo = hi
    return greedy


def terminal_signals() -> None:
    """`preexec_fn` for a child a test stops with Ctrl-C: SIGINT as a terminal's foreground job
    has it. A test runner started in the background ignores SIGINT, a child inherits an ignored
    signal, and Python then never raises KeyboardInterrupt in it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
