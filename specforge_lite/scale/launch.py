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

The ranks live and die with the command that started them: each rank follows its launcher
(`rank_side.follow_launcher`: a parent-death signal where Linux gives one, and a thread that
watches the launcher's pid everywhere), so a launcher killed outright (`kill -9`, the OOM killer)
leaves no rank training on in the run folder. A rank that dies ends the run with one line
naming it, how it ended, its log and how to resume (`failure_line`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.run_folders import STAGE_DIRS, folder_locks, samples_dir
from specforge_lite.stage_table import COMMANDS, RUN, SAMPLE, TRAIN, chained
from specforge_lite.scale.rank_side import LAUNCHER_PID, RANK_LOGS
from specforge_lite.scale.rendezvous import free_port

log = logging.getLogger(__name__)

# the environment a launcher leaves in each rank it starts
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
# what `launch` leaves in the environment of the ranks it starts: its own pid, and the folder of their logs


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
        from specforge_lite.serving.vllm.interpreter import find_python

        return find_python(cfg.sample.vllm.python) is not None
    return requested == "vllm"


def single_process_reason(cfg, stage: str) -> str | None:
    """Why `stage` runs in one process under this config, or None when it may fan out."""
    if not COMMANDS[stage].multi_rank:  # stage_table.py: evaluate and export run in one process
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
    # auto_port: `launch` takes a free port again when it starts the ranks (a plan made before an
    # earlier stage ran may find its port taken since)
    return {"nproc_per_node": nproc, "nnodes": nnodes, "node_rank": int(cfg.trainer.node_rank),
            "master_addr": cfg.trainer.master_addr, "master_port": int(port),
            "auto_port": cfg.trainer.master_port is None and nnodes == 1, "cfg": cfg}  # cfg: for `stopped_line`


def launch(plan: dict, stage: str, overrides: list[str], log_dir: Path | None = None) -> int:
    """Run `python -m specforge_lite STAGE OVERRIDES` on `plan`'s ranks through torch's
    elastic launcher; returns the exit status (a failed rank's own status, 128+N for a rank
    killed by signal N). Each rank's output is copied to `log_dir/rank-R.log` (by default this
    command's Hydra log folder); a failed rank ends the run with `failure_line`."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world = plan["nproc_per_node"] * plan["nnodes"]
    port = free_port() if plan.get("auto_port") else plan["master_port"]
    log_dir = Path(log_dir or hydra_output_dir() or Path.cwd())
    config = LaunchConfig(
        min_nodes=plan["nnodes"], max_nodes=plan["nnodes"], nproc_per_node=plan["nproc_per_node"],
        run_id=os.environ.get("SLURM_JOB_ID", f"specforge_lite-{stage}-{os.getpid()}"),
        rdzv_backend="static", rdzv_endpoint=f"{plan['master_addr']}:{port}",
        rdzv_configs={"rank": plan["node_rank"]}, max_restarts=0, monitor_interval=0.5,
        start_method="spawn",
        # the ranks write their own logs (`follow_launcher`); torch's default makes a folder in the temp dir
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull))
    log.info("%s: starting %d rank(s) (%d per node, %d node(s)) with torch's elastic launcher; their logs: %s",
             stage, world, plan["nproc_per_node"], plan["nnodes"], log_dir / "rank-*.log")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan["nproc_per_node"])))
    os.environ[LAUNCHER_PID], os.environ[RANK_LOGS] = str(os.getpid()), str(log_dir)
    args = ["-m", "specforge_lite", stage, *overrides]
    elastic_logs = logging.getLogger("torch.distributed.elastic")
    quiet = not os.environ.get("SPECFORGE_LITE_DEBUG")  # our line says what its lines would
    level = elastic_logs.level
    if quiet:
        elastic_logs.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args)
    except SignalException as stop:  # Ctrl-C or SIGTERM reached this process: torch stopped the ranks
        print(f"\n{stopped_line(stage, int(stop.sigval), world, plan.get('cfg'))}", file=sys.stderr)
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        rank, failure = first_failure(failed.failures)
        if failure.exitcode in (128 + signal.SIGINT, -signal.SIGINT):  # Ctrl-C reached the ranks first
            print(f"\n{stopped_line(stage, signal.SIGINT, world, plan.get('cfg'))}", file=sys.stderr)
            return 128 + signal.SIGINT
        # on a line of its own: a rank's progress bar (shared stderr) may have stopped mid-line
        print(f"\nerror: {failure_line(stage, rank, failure.pid, failure.exitcode, log_dir)}", file=sys.stderr)
        code = failure.exitcode
        return 128 - code if code < 0 else code or 1
    finally:
        elastic_logs.setLevel(level)
        for key in (LAUNCHER_PID, RANK_LOGS):
            os.environ.pop(key, None)
    return 0


def first_failure(failures: dict) -> tuple[int, object]:
    """The failure that ended the run, of torch's `{global rank: ProcessFailure}`: a rank killed
    by a signal other than the SIGTERM the launcher sends the rest, else the earliest rank that
    exited on its own (timestamps are whole seconds: one stopped by SIGTERM comes last)."""
    def order(item):
        rank, failure = item
        stopped = failure.exitcode == -signal.SIGTERM
        killed = failure.exitcode < 0 and not stopped
        return (0 if killed else 2 if stopped else 1, failure.timestamp, rank)

    return min(failures.items(), key=order)


def failure_line(stage: str, rank: int, pid: int, exitcode: int, log_dir: Path) -> str:
    """One line for a rank that ended the run: which rank, how it ended, its log, how to resume."""
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
        how = f"was killed by {name}" + (" (out of memory, or `kill -9`)" if exitcode == -signal.SIGKILL else "")
    else:
        how = f"exited with status {exitcode}"
    log_file = Path(log_dir) / f"rank-{rank}.log"
    if exitcode == 2:  # a user error the rank reported itself: running again would meet it again
        return f"{stage}: rank {rank} (pid {pid}) stopped on the error above; its log: {log_file}"
    resume = COMMANDS[stage].resumes if stage in COMMANDS else ""  # stage_table.py
    return (f"{stage}: rank {rank} (pid {pid}) {how}, so the run stopped its other ranks; its log: "
            f"{log_file}; run the same command again to resume {resume}".rstrip())


def stopped_line(stage: str, signum: int, ranks: int = 0, cfg=None) -> str:
    """The one line for a command stopped by a signal: Ctrl-C (SIGINT) or another (SIGTERM from a
    scheduler), its ranks stopped with it, and what the same command does next, as `cfg`'s folders
    say now (`next_step`)."""
    by = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    try:
        then = next_step(stage, cfg)
    except OSError:  # a folder it cannot read: the line still comes, and promises nothing
        then = next_step(stage)
    return (f"stopped: {stage} stopped by {by}" + (f", and its {ranks} ranks with it" if ranks else "")
            + f"; the same command {then}")


def next_step(stage: str, cfg=None) -> str:
    """What the same command does after `stage` was stopped, from what is on disk: sample resumes
    from the shards written, train from its newest complete checkpoint or else starts over, evaluate
    and export run again (they write only when done). Without `cfg`, nothing more precise."""
    if cfg is None:  # no folders to look at: where it resumes is not known
        return "picks up the work that is not done yet"
    if stage == RUN.name:  # the stage `run` was in (each records itself as it begins); the earlier ones are kept
        from specforge_lite.targets import accounting

        stage = accounting.current_stage() or SAMPLE.name
    if stage == SAMPLE.name or (stage == TRAIN.name and samples_missing(cfg)):
        from specforge_lite.data.samples import completed_shards

        written = len(completed_shards(samples_dir(cfg) / "data"))
        then = ", then trains" if stage == TRAIN.name else ""
        return (f"resumes sampling from the {written} shard(s) already written{then}" if written
                else f"starts sampling over: no shard was complete yet{then}")
    if stage != TRAIN.name:
        return f"runs {stage} again from the start (it writes its output only when done)"
    from specforge_lite.training.checkpoints import latest_checkpoint

    if not cfg.train.resume:
        return "starts training over (train.resume=false sets the checkpoints aside)"
    newest = latest_checkpoint(Path(cfg.run_dir) / TRAIN.folder / "checkpoints")
    if newest is not None:  # complete (it has its state.json): the resume loads it, or an older one if damaged
        return f"resumes from its newest checkpoint (step {int(newest.name.split('-')[-1])})"
    if not cfg.train.checkpoint_every:
        return ("starts training over: checkpoints are off (train.checkpoint_every=0); give "
                "train.checkpoint_every=N to keep progress")
    return f"starts training over: no checkpoint was written yet (one every {cfg.train.checkpoint_every} steps)"


def hydra_output_dir() -> Path | None:
    """This command's Hydra log folder (`run_dir/logs/<time>-<stage>`), None outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


@contextmanager
def run_folder_locks(cfg):
    """Hold the locks of the folders this command writes (`locked_folders`) while it runs: a
    second command on them is refused, naming this one's pid. Taken by the command the user
    typed (rank 0 under another launcher), never by the ranks `launch` starts for it."""
    if os.environ.get(LAUNCHER_PID) or int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    if cfg.stage == SAMPLE.name and int(cfg.sample.rank or 0) != 0:  # a hand-started sampling rank: rank 0 locks
        yield
        return
    with folder_locks(locked_folders(cfg), f"specforge_lite {cfg.stage}"):
        yield


def locked_folders(cfg) -> list[Path]:
    """The folders the command `cfg.stage` writes: each stage's own, and the samples where train
    samples first (none complete yet)."""
    folders: list[Path] = []
    for stage in chained(cfg.stage):
        for name in stage.writes:
            if name == SAMPLE.name and stage.name != SAMPLE.name and not samples_missing(cfg):
                continue
            folder = samples_dir(cfg) if name == SAMPLE.name else Path(cfg.run_dir) / STAGE_DIRS[name]
            if folder not in folders:
                folders.append(folder)
    return folders


def samples_missing(cfg) -> bool:
    """Whether train will sample first: it trains on samples and none complete are there."""
    if not cfg.train.use_samples:
        return False
    from specforge_lite.data.samples import samples_meta

    return not samples_meta(samples_dir(cfg)).get("complete")


def stage_overrides() -> list[str]:
    """The command line's overrides as Hydra parsed them, less the `stage=` the CLI added."""
    from hydra.core.hydra_config import HydraConfig

    return [o for o in HydraConfig.get().overrides.task if not o.startswith("stage=")]
