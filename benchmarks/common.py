"""The benchmarks' harness: one-line errors, the CLI in a child, the composed config, the
embedded target and prompts; and, from `specforge_lite.records`, timing, intervals, results JSON
and docs sections.

Every script under benchmarks/GROUP/ times with `timed`/`median_ms`, prints intervals with
`with_ci`, writes `benchmarks/results/NAME.json` with `write_results` and its section of
docs/BENCHMARKS.md with `update_doc_section`, and ends with `run(main)`: a `SpecforgeError`
(an unknown recipe, a missing run, a failed stage) then prints one `error:` line and exits 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, NoReturn

from specforge_lite import SpecforgeError
# what every script writes and reads with, from the package (one writer of results and docs sections)
from specforge_lite.records.results import (RESULTS, ROOT, load_results, machine, num, read_results,  # noqa: F401
                                            with_ci, write_results)
from specforge_lite.records.runs import needed, paired_tau_difference, run_file  # noqa: F401
from specforge_lite.records.timing import interleaved, median_ms, timed  # noqa: F401
from specforge_lite.records.topics import DOC, update_doc_section  # noqa: F401

RECIPES = ROOT / "specforge_lite" / "conf" / "recipe"
USER_ERROR = 2  # the exit status of the CLI's one-line errors


# --- errors -----------------------------------------------------------------------------

def run(main: Callable[[], object]) -> None:
    """A script's entry point: `main()`, a `SpecforgeError` printed as one line with exit 2."""
    try:
        main()
    except SpecforgeError as err:
        if os.environ.get("SPECFORGE_LITE_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR)


def fail(message: str) -> NoReturn:
    raise SpecforgeError(message)


def choose(name: str | None, known, what: str) -> str:
    """`name` if it is one of `known`, else an error that lists them (also when no name was given)."""
    known = sorted(known)
    if name not in known:
        fail(f"{f'unknown {what} {name!r}' if name else f'no {what} given'}; known: {', '.join(known) or '(none)'}")
    return name


def asks_help(argv: list[str], doc: str) -> bool:
    """For a script of steps (no argparse): print its docstring when argv is -h or --help."""
    if argv[:1] in (["-h"], ["--help"]):
        print(doc)
        return True
    return False


def known_recipe(name: str) -> str:
    """A recipe of specforge_lite/conf/recipe/ (as `+recipe=NAME` spells it), else the list of them."""
    return choose(name, (p.stem for p in RECIPES.glob("*.yaml")), "recipe")


def run_cli(args: list[str], what: str, launcher: list[str] | None = None, env: dict | None = None,
            quiet: bool = True) -> float:
    """`python -m specforge_lite ARGS` (under `launcher`, e.g. torchrun's module) in this checkout;
    its wall seconds. A failure is an error with the stage's last line of stderr."""
    command = [sys.executable, *(launcher or []), "-m", "specforge_lite", *args]
    done, seconds = timed(lambda: subprocess.run(command, cwd=ROOT, env=env, capture_output=quiet, text=True))
    if done.returncode:
        last = [line for line in (done.stderr or "").splitlines() if line.strip()][-1:] or ["(its output is above)"]
        fail(f"{what} failed (exit {done.returncode}): {last[0].strip()}")
    return seconds


def compose_config(overrides: list[str]):
    """The run config the CLI would build from these overrides (conf/ of this checkout)."""
    from hydra import compose, initialize_config_dir

    from specforge_lite.drafters.registry import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "specforge_lite" / "conf")):
        return compose(config_name="config", overrides=overrides)


# the embedded SmolLM2-135M-Instruct target, fp32 on CPU, as a `target` config
SMOLLM2 = {"path": "builtin:smollm2-135m-instruct", "dtype": "float32", "device": "cpu", "chat_template": None,
           "trust_remote_code": False}


def load_smollm2():
    """The embedded SmolLM2-135M-Instruct target, fp32 on CPU: (model, tokenizer)."""
    from omegaconf import OmegaConf

    from specforge_lite.targets.loading import load_target

    return load_target(OmegaConf.create(SMOLLM2))


def sharegpt_first_turns(tokenizer, count: int, max_tokens: int) -> list[list[int]]:
    """Prompt ids of the first user turns of ShareGPT train conversations (the held-out
    split left out), the first `count` of at most `max_tokens` tokens."""
    from specforge_lite.data.chat import prompt_ids
    from specforge_lite.data.readers import heldout_split, read_conversations

    records, _ = read_conversations("builtin:sharegpt")
    train, _ = heldout_split(records, 0.02, 0)
    prompts = []
    for record in train:
        ids = prompt_ids(tokenizer, record["messages"][:1])
        if len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts
