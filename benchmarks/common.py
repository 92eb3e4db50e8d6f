"""Shared by the benchmark scripts: results JSON and the sections of docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import platform
import re
import time
from pathlib import Path

from benchmarks.doc_topics import order_benchmarks
from specforge_lite.artifacts import package_versions

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "BENCHMARKS.md"

HEADER = """# Benchmarks

Every number here is written by a script in `benchmarks/` from a run on the machine
named in its section; re-run the command to reproduce it. Ratios are measured inside
one run (the machines are shared and noisy); absolute tokens/s vary between runs.
"""


def machine() -> str:
    import os

    import torch

    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}"
            + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"))


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
               "versions": package_versions(), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def update_doc_section(name: str, markdown: str) -> None:
    """Replace (or append) the section between `<!-- name -->` markers in docs/BENCHMARKS.md."""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else HEADER
    block = f"<!-- {name} -->\n{markdown.strip()}\n<!-- /{name} -->"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(order_benchmarks(text))  # a new section goes under its topic, in the contents


def compose_config(overrides: list[str]):
    """The run config the CLI would build from these overrides (conf/ of this checkout)."""
    from hydra import compose, initialize_config_dir

    from specforge_lite.config.schema import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "specforge_lite" / "conf")):
        return compose(config_name="config", overrides=overrides)


def load_smollm2():
    """The embedded SmolLM2-135M-Instruct target, fp32 on CPU: (model, tokenizer)."""
    from omegaconf import OmegaConf

    from specforge_lite.target.loading import load_target

    return load_target(OmegaConf.create({"path": "builtin:smollm2-135m-instruct", "dtype": "float32",
                                         "device": "cpu", "chat_template": None, "trust_remote_code": False}))


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
