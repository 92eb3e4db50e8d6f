"""Whether an installed vLLM can serve a static draft tree: the probe the GPU check records.

vLLM takes a tree for EAGLE as `speculative_token_tree` (a list of node paths in its
SpeculativeConfig) verified by a tree attention backend. The probe runs in vLLM's own
interpreter (`engine.find_python`) and reads both from the installed package, without loading
a model: the config's field names and the attention backends that name a tree. The export
writes the tree either way (docs/ENGINES.md, "Draft trees").
"""

from __future__ import annotations

import json
import subprocess

from specforge_lite import SpecforgeError

PROBE = r"""
import dataclasses, importlib.util, json
import vllm
from vllm.config import SpeculativeConfig
try:
    names = set(SpeculativeConfig.model_fields)
except AttributeError:
    names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
backends = []
try:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    backends = [name for name in AttentionBackendEnum.__members__ if "TREE" in name]
except ImportError:
    pass
if importlib.util.find_spec("vllm.v1.attention.backends.tree_attn") is not None:
    backends.append("vllm.v1.attention.backends.tree_attn")
print(json.dumps({"vllm": vllm.__version__, "speculative_token_tree": "speculative_token_tree" in names,
                  "tree_attention_backends": sorted(set(backends))}))
"""


def tree_support(python: str, timeout: float = 180) -> dict:
    """{"vllm": version, "speculative_token_tree": the config takes a tree, "tree_attention_backends":
    the backends that name one, "serves_trees": both} of the vLLM that `python` imports."""
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SpecforgeError(f"the vLLM tree probe could not run in {python}: {err}") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        said = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SpecforgeError(f"the vLLM tree probe failed in {python}: {said}")
    info = json.loads(lines[-1])
    info["serves_trees"] = bool(info["speculative_token_tree"] and info["tree_attention_backends"])
    return info
