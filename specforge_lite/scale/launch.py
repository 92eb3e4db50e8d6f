"""One command per stage: a stage started as one plain process starts its own ranks.

`python -m specforge_lite train +recipe=NAME` on a node with N GPUs (or with
`trainer.num_processes=N`, `trainer.num_nodes=M`) re-runs the same command line under
torch's elastic launcher (`torch.distributed.launcher.elastic_launch`, what `torchrun`
runs), as Lightning does for `devices="auto"`. Nothing is launched when a launcher already
started this process (torchrun, accelerate launch, srun with several tasks: their
environment variables say so), or when the stage runs in one process by design:

- `sample` with the vLLM backend: one process drives the vLLM engine, which spreads the
  target over `sample.vllm.tensor_parallel_size` devices itself (N ranks would start N
  engines of that size);
- `evaluate` and `export`: one process (vLLM's tensor parallelism, or the target's tensors
  read one at a time);
- `run`: each stage decides for itself, so `run` launches `sample` and `train` and runs
  `evaluate` and `export` in this process.

The config is validated before anything is launched, so a bad setting stops once with one
message; a rank's exit status is this process's exit status.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from specforge_lite import SpecforgeError
from specforge_lite.config.stages import COMMANDS

log = logging.getLogger(__name__)

# the environment a launcher leaves in each rank it starts
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def launched_by() -> str | None:
    """The launcher that started this process, or None for a plain process."""
    env = os.environ
    if any(k in env for k in LAUNCHER_VARIABLES):
        return "torchrun" if "TORCHELASTIC_RUN_ID" in env else "a launcher (RANK/WORLD_SIZE set)"
    if any(k.startswith("ACCELERATE_") and k != "ACCELERATE_LOG_LEVEL" for k in env):
        return "accelerate"
    # srun with several tasks starts the ranks itself; a batch script (one task) does not
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "srun"
    return None


def num_processes(cfg) -> int:
    """`trainer.num_processes`, auto (null) resolved to the CUDA devices this process sees."""
    if cfg.trainer.num_processes is not None:
        return int(cfg.trainer.num_processes)
    import torch

    if cfg.target.device == "cpu" or not torch.cuda.is_available():
        return 1
    return torch.cuda.device_count()


def sample_uses_vllm(cfg) -> bool:
    """sample.backend=vllm, or auto where an interpreter with vLLM is found (as the stage resolves it)."""
    requested = getattr(cfg.sample.backend, "value", cfg.sample.backend)
    if requested == "auto":
        from specforge_lite.serving.vllm.engine import find_python

        return find_python(cfg.sample.vllm.python) is not None
    return requested == "vllm"


def single_process_reason(cfg, stage: str) -> str | None:
    """Why `stage` runs in one process under this config, or None when it may fan out."""
    if not COMMANDS[stage].multi_rank:  # config/stages.py: evaluate and export run in one process
        return f"{stage} runs in one process"
    if stage == "sample" and sample_uses_vllm(cfg):
        return (f"sample.backend={getattr(cfg.sample.backend, 'value', cfg.sample.backend)} (vLLM): one process "
                f"drives the vLLM engine "
                f"(tensor_parallel_size={cfg.sample.vllm.tensor_parallel_size})")
    if stage == "train" and cfg.train.dry_run:
        return "train.dry_run=true sizes the run in one process"
    return None


def launch_plan(cfg, stage: str) -> dict | None:
    """`{nproc_per_node, nnodes, ...}` when `stage` should start its own ranks, else None."""
    if launched_by() is not None:
        return None
    nproc, nnodes = num_processes(cfg), int(cfg.trainer.num_nodes)
    if cfg.trainer.node_rank >= nnodes:
        raise SpecforgeError(f"trainer.node_rank={cfg.trainer.node_rank} with trainer.num_nodes={nnodes}: "
                             "the node rank must be below the number of nodes")
    if nproc * nnodes <= 1:
        return None
    reason = single_process_reason(cfg, stage)
    if reason is not None:
        log.info("%s: not launched on %d rank(s)", reason, nproc * nnodes)
        return None
    port = cfg.trainer.master_port
    if port is None:
        port = free_port() if nnodes == 1 else 29500
    return {"nproc_per_node": nproc, "nnodes": nnodes, "node_rank": int(cfg.trainer.node_rank),
            "master_addr": cfg.trainer.master_addr, "master_port": int(port)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(plan: dict, stage: str, overrides: list[str]) -> int:
    """Run `python -m specforge_lite STAGE OVERRIDES` on `plan`'s ranks through torch's
    elastic launcher; returns the exit status (a failed rank's own status)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world = plan["nproc_per_node"] * plan["nnodes"]
    config = LaunchConfig(
        min_nodes=plan["nnodes"], max_nodes=plan["nnodes"], nproc_per_node=plan["nproc_per_node"],
        run_id=os.environ.get("SLURM_JOB_ID", f"specforge_lite-{stage}-{os.getpid()}"),
        rdzv_backend="static", rdzv_endpoint=f"{plan['master_addr']}:{plan['master_port']}",
        rdzv_configs={"rank": plan["node_rank"]}, max_restarts=0, monitor_interval=0.5,
        start_method="spawn")
    log.info("%s: starting %d rank(s) (%d per node, %d node(s)) with torch's elastic launcher",
             stage, world, plan["nproc_per_node"], plan["nnodes"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan["nproc_per_node"])))
    args = ["-m", "specforge_lite", stage, *overrides]
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as failed:
        codes = [f.exitcode for f in failed.failures.values()]
        # the first rank's own status: 2 for a user error, a signal's negative number as 128+N
        code = next((c for c in codes if c and c > 0), 1)
        return code
    return 0


def stage_overrides() -> list[str]:
    """The command line's overrides as Hydra parsed them, less the `stage=` the CLI added."""
    from hydra.core.hydra_config import HydraConfig

    return [o for o in HydraConfig.get().overrides.task if not o.startswith("stage=")]
