"""Command line: `python -m specforge_lite STAGE [hydra overrides]`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.stage_table import COMMANDS
from specforge_lite.scale.rank_side import follow_launcher

USAGE = """usage: python -m specforge_lite STAGE [+recipe=NAME] [key=value ...] [--cfg job]
       python -m specforge_lite COMMAND [--help | its options]

stages:
{stages}

commands (no Hydra config; `COMMAND --help` lists their options):
{tools}

examples:
  python -m specforge_lite sample +recipe=eagle_smollm2 data.max_samples=32
  python -m specforge_lite run +recipe=smoke
  python -m specforge_lite train +recipe=eagle_smollm2 --cfg job    # print the resolved config

recipes: {recipes}
`python -m specforge_lite STAGE --help` shows Hydra's help for a stage (config groups and options).
A bad setting or input file stops the run with one `error:` message and exit status 2
(SPECFORGE_LITE_DEBUG=1 adds the traceback).
"""

CONF_DIR = Path(__file__).resolve().parent / "conf"  # shipped inside the package

log = logging.getLogger("specforge_lite")

# A user-facing error (SpecforgeError: bad config, bad input, a damaged artifact) prints one
# `error:` message and exits with status 2; this variable adds the traceback (and Hydra's).
DEBUG_ENV = "SPECFORGE_LITE_DEBUG"
USER_ERROR = 2
_dispatched = False  # set once Hydra has composed the config and handed it to us


def _usage() -> str:
    stages = "\n".join(f"  {s.name:<9} {s.help}" + (f" (runs/<recipe>/{s.folder})" if s.folder else "")
                       for s in COMMANDS.values())
    tools = "\n".join(f"  {name:<9} {help}" for name, help in TOOLS.items())
    recipes = ", ".join(sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))) or "(none found)"
    return USAGE.format(stages=stages, tools=tools, recipes=recipes)


class Stopped(BaseException):
    """SIGTERM reached the command typed: raised where it runs, so that it unwinds as Ctrl-C does."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    raise Stopped(signum)


class HeldStream:
    """stderr while Hydra composes the config: what Hydra writes is held until the command starts
    (then written out, and everything after passes straight through) or, where Hydra refused an
    override, said in one `error:` line (`one_line`). A logging handler bound to it keeps working."""

    def __init__(self, real):
        self.real, self.held, self.passing = real, [], False

    def write(self, text: str) -> int:
        if self.passing:
            return self.real.write(text)
        self.held.append(text)
        return len(text)

    def release(self) -> None:
        self.passing = True
        self.real.write("".join(self.held))
        self.held = []

    def one_line(self) -> str | None:
        """Hydra's refusal of an override (several lines: the override, the reason, full_key, types
        and its HYDRA_FULL_ERROR hint) as one line: the override and the reason."""
        lines = [line.strip() for line in "".join(self.held).splitlines() if line.strip()]
        said = [line for line in lines if not line.startswith(("full_key:", "reference_type", "object_type",
                                                                "Set the environment variable HYDRA_FULL_ERROR"))]
        if not said:
            return None
        head = said[0].replace("Error merging override ", "").rstrip(".")
        return "; ".join([head + (f": {said[1]}" if len(said) > 1 else ""), *said[2:]])

    def __getattr__(self, name):
        return getattr(self.real, name)


_held: HeldStream | None = None


def _dispatch(cfg) -> None:
    global _dispatched
    _dispatched = True
    if _held is not None and sys.stderr is _held:  # Hydra composed the config: its output and ours flow again
        sys.stderr = _held.real
        _held.release()
    from specforge_lite.run_folders import folder_error
    from specforge_lite.scale.launch import stopped_line
    from specforge_lite.scale.rank_side import LAUNCHER_PID
    from specforge_lite.stages import run_stage

    rank = bool(os.environ.get(LAUNCHER_PID))  # a rank: its launcher says the one line
    if not rank and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop)
    try:
        run_stage(cfg)
    except (KeyboardInterrupt, Stopped) as stop:  # the shell's status for the signal, no traceback
        signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
        if not rank:
            print(f"\n{stopped_line(cfg.stage, signum, cfg=cfg)}", file=sys.stderr)
        sys.exit(128 + signum)
    except (SpecforgeError, OSError) as err:
        # an OSError counts as the user's only under a folder they named (run_dir, the caches)
        message = str(err) if isinstance(err, SpecforgeError) else folder_error(cfg, err)
        if message is None:
            raise
        if os.environ.get(DEBUG_ENV):
            traceback.print_exc()
        print(f"error: {message}", file=sys.stderr)
        sys.exit(USER_ERROR)


# commands that are no stage: they take their own options and run before Hydra composes anything
TOOLS = {"docs": "write the figures of the recipe cards, README and docs/BENCHMARKS.md from benchmarks/results",
         "gpu-check": "on one CUDA GPU: GPU tests, demo training, bf16/fp32 evaluation, projections, recorded",
         "families": "run the family tests (every stage, each forward) and record the family x stage x engine table"}


def run_tool(name: str, argv: list[str]) -> int:
    """A command of TOOLS with its own options; a SpecforgeError (a damaged results file, an unknown
    step) is one `error:` line and exit status 2, as for a stage."""
    from specforge_lite.records import docs, families, gpu_check  # they import torch: loaded for these only

    try:
        return {"docs": docs.main, "gpu-check": gpu_check.main, "families": families.main}[name](argv)
    except SpecforgeError as err:
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"error: {err}", file=sys.stderr)
        return USER_ERROR


# command-line spellings of earlier versions -> what to write now
RENAMED_OVERRIDES = {
    "drafter.name": "the drafter is chosen by its group: drafter=eagle3 | medusa | distilled",
    "drafter=draft_model": "the trained draft model is now drafter=distilled",
    "eval.draft_model": "the untrained draft model's path is now eval.untrained_draft_path",
}


def renamed(overrides: list[str]) -> str | None:
    """The message for an override spelled as an earlier version did, or None."""
    for item in overrides:
        key = item.lstrip("+~").split("=", 1)[0]
        for old, new in RENAMED_OVERRIDES.items():
            if item.lstrip("+~") == old or (key == old and "=" not in old):
                return f"{item}: renamed; {new}"
        if key == "eval.methods" and "draft_model" in item.split("=", 1)[-1].replace("untrained_draft", ""):
            return (f"{item}: method draft_model was renamed: untrained_draft (a draft model used as it is) or "
                    "distilled (one trained here)")
    return None


def run_dir_problem(overrides: list[str]) -> str | None:
    """Why a `run_dir=` given on the command line cannot be written, or None: checked before
    Hydra, which makes its log folder there first."""
    from specforge_lite.run_folders import folder_problem

    given = [item.split("=", 1)[1] for item in overrides if item.lstrip("+").startswith("run_dir=")]
    return folder_problem(Path(given[-1]), "run_dir") if given and given[-1].strip() else None


def unresolved(err: Exception, overrides: list[str]) -> str:
    """The line for an interpolation Hydra could not resolve while it made the run's log folder
    (hydra.run.dir is `${run_dir}/logs/...`), before any stage ran: it names run_dir and the value
    given, not Hydra's own key."""
    key = getattr(err, "full_key", None) or "run_dir"
    if key == "hydra.run.dir" and not any(item.lstrip("+~").startswith(f"{key}=") for item in overrides):
        key = "run_dir"
    given = [item.split("=", 1)[1] for item in overrides if item.lstrip("+~").startswith(f"{key}=")]
    shown = f"{key}={given[-1]!r}" if given else key
    return (f"{shown}: cannot resolve its value ({str(err).splitlines()[0]}); write the path out, or interpolate a "
            f"key the config has ({key}=runs/${{recipe_name}})")


def unresolved_run_dir(stage: str, overrides: list[str]) -> str | None:
    """Why the run's log folder cannot be named, or None. Hydra resolves it (`hydra.run.dir`,
    under run_dir) before our door and reports an interpolation that does not resolve as a
    traceback, so an override that interpolates (`${...}`) is tried here first; a config Hydra
    cannot compose is left for Hydra to report in its own words."""
    if not any("${" in item for item in overrides):
        return None
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            cfg = compose(config_name="config", overrides=[f"stage={stage}", *overrides], return_hydra_config=True)
    except Exception:
        return None
    try:
        OmegaConf.select(cfg, "hydra.run.dir", throw_on_resolution_failure=True)
    except InterpolationResolutionError as err:
        return unresolved(err, overrides)
    return None


def compose_once(overrides: list[str]) -> None:
    """Hydra's `main` composes the whole config once only to read `hydra.mode`, then again to run.
    Our configs set no hydra.mode (tests/unit/test_cli_config.py checks every recipe), so unless an
    override sets it the answer is None, which is what the first compose would find: Hydra then
    takes the mode from its -m flag, as it does now."""
    if any(item.lstrip("+~").startswith("hydra.mode") for item in overrides):
        return
    from hydra._internal.hydra import Hydra

    Hydra.get_mode = lambda self, config_name, overrides: None


def main(argv: list[str] | None = None) -> None:
    global _dispatched
    _dispatched = False
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        sys.exit(0 if argv else 2)
    stage, rest = argv[0], argv[1:]
    if stage in TOOLS:
        sys.exit(run_tool(stage, rest))
    if stage not in COMMANDS:
        print(f"error: unknown stage {stage!r}; choose one of: {', '.join([*COMMANDS, *TOOLS])}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        sys.exit(2)
    if not CONF_DIR.is_dir():
        print(f"error: config directory {CONF_DIR} not found: the installation is incomplete (reinstall the package)",
              file=sys.stderr)
        sys.exit(2)

    if message := renamed(rest) or run_dir_problem(rest):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    follow_launcher()  # a rank started by scale/launch.py ends with its launcher and writes its log

    import hydra

    from specforge_lite.drafters.registry import register_configs

    register_configs()
    if message := unresolved_run_dir(stage, rest):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(USER_ERROR)
    if os.environ.get(DEBUG_ENV):
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    compose_once(rest)
    task = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_dispatch)
    sys.argv = [f"specforge_lite {stage}", f"stage={stage}", *rest]
    from omegaconf.errors import InterpolationResolutionError

    global _held
    _held = None if os.environ.get(DEBUG_ENV) else HeldStream(sys.stderr)
    if _held is not None:
        sys.stderr = _held
    try:
        task()
    except InterpolationResolutionError as err:  # Hydra's own keys (its log folder), resolved before our door
        if _dispatched or os.environ.get(DEBUG_ENV):
            raise
        _restore_stderr(said=True)
        print(f"error: {unresolved(err, rest)}", file=sys.stderr)
        sys.exit(USER_ERROR)
    except SystemExit as done:
        # Hydra reports a config it cannot compose (unknown key, wrong type, bad override)
        # in its own words and exits with 1; that is the user's input too: said in one line
        if done.code == 1 and not _dispatched:
            line = _held.one_line() if _held is not None else None
            _restore_stderr(said=line is not None)
            if line:
                print(f"error: {line}", file=sys.stderr)
            sys.exit(USER_ERROR)
        raise
    finally:
        _restore_stderr(said=False)


def _restore_stderr(said: bool) -> None:
    """stderr back from Hydra's hold: what it held is written unless `said` replaced it."""
    if _held is not None and sys.stderr is _held:
        sys.stderr = _held.real
        if said:
            _held.held = []
        _held.release()


if __name__ == "__main__":
    main()
