"""The stages, in one table: what each is called on the command line, the module that runs
it, its folder under run_dir, whether it may start ranks of its own, what it writes and its
line of help. The CLI, the validation, the launcher, the sizing and the stage runner all
read this table; it imports nothing of the package (strings name the stage modules), so any
module may read it without an upward arrow."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str  # the command line's STAGE
    module: str | None  # the module whose `run(cfg)` runs it; None for `run`, which chains the others
    folder: str | None  # its folder under run_dir (`run_folders.stage_dir`); None for `run`
    multi_rank: bool  # may start ranks of its own (scale/launch.py); else it runs in one process
    writes: tuple[str, ...]  # the stages whose folders it writes (train samples first when it finds none)
    help: str  # one line for `python -m specforge_lite --help`
    builds_drafter: bool = False  # builds a drafter for the target: checked against the target's config
    sizing_rows: tuple[str, ...] = ()  # the rows of `scale.sizing.stage_table` that must fit before it loads
    resumes: str = ""  # where the same command run again picks up (a failed rank's line, scale/launch.py)


SAMPLE = Stage("sample", "specforge_lite.stages.sample", "samples", multi_rank=True, writes=("sample",),
               help="run the target over a prompt set and record its own answers", sizing_rows=("sample",),
               resumes="from the shards already written")
TRAIN = Stage("train", "specforge_lite.stages.train", "train", multi_rank=True, writes=("sample", "train"),
              help="train a drafter on the samples", builds_drafter=True, sizing_rows=("features", "train"),
              resumes="from its newest checkpoint")
EVALUATE = Stage("evaluate", "specforge_lite.stages.evaluate", "eval", multi_rank=False, writes=("evaluate",),
                 help="measure acceptance length and speedup against plain decoding and other drafters",
                 sizing_rows=("evaluate", "evaluate_vllm"))
EXPORT = Stage("export", "specforge_lite.stages.export", "export", multi_rank=False, writes=("export",),
               help="write a checkpoint vLLM loads", sizing_rows=("export",))

STAGES = (SAMPLE, TRAIN, EVALUATE, EXPORT)  # in the order `run` chains them
ORDER = tuple(s.name for s in STAGES)
RUN = Stage("run", None, None, multi_rank=False, writes=ORDER, help="all of the above, in order",
            builds_drafter=True)
COMMANDS = {s.name: s for s in (*STAGES, RUN)}  # what the command line accepts as STAGE, in help order


def chained(name: str) -> tuple[Stage, ...]:
    """The stages the command `name` runs: all of them in order for `run`, else the one."""
    return STAGES if name == RUN.name else (COMMANDS[name],)


def runs(command: str, name: str) -> bool:
    """True when the command `command` (a stage or `run`) runs the stage `name`."""
    return any(s.name == name for s in chained(command))
