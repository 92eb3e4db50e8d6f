"""The `llamacpp_*` evaluate methods: llama.cpp itself (xllamacpp, in-process) decoding the
evaluate stage's own requests (every prompt and turn, the same token ids as our methods).

Each method gets its own llama.cpp server on the one target GGUF (`files.target_gguf`),
one untimed warm-up per `eval.warmup`, then every request, batch 1, greedy, exactly
`eval.max_new_tokens` new tokens (end of sequence ignored), k = `eval.num_draft_tokens`.
`llamacpp_plain` always runs first: the other methods' outputs are compared with it. They run
one after another after our interleaved methods: llama.cpp's threads spin-wait, so nothing
else may run beside them.
"""

from __future__ import annotations

import logging

import torch

from specforge_lite import SpecforgeError
from specforge_lite.serving.llamacpp.checks import DRAFT_OF, draft_gguf
from specforge_lite.serving.llamacpp.files import target_gguf
from specforge_lite.serving.llamacpp.runner import (
    METHODS,
    SPEC_TYPE_FLAGS,
    LlamaCppRunner,
    version,
)

log = logging.getLogger(__name__)
PLAIN = "llamacpp_plain"


def run_methods(cfg, methods: list[str], requests: list[list[int]], target_path: str | None = None) -> dict:
    """{"xllamacpp", "threads", "target_gguf", "target_precision", "results": {method:
    {"spec_type", "draft_gguf", "completions"} or {"error"}}} over every request
    (`target_path`: target.path already resolved, else resolved here)."""
    ecfg = cfg.eval
    target, precision = target_gguf(cfg.target.path, target_path)
    threads = torch.get_num_threads()
    results = {}
    for method in [PLAIN] + [m for m in methods if m != PLAIN]:
        draft = draft_gguf(cfg.run_dir, method) if method in DRAFT_OF else None
        entry = {"spec_type": SPEC_TYPE_FLAGS.get(METHODS[method]), "draft_gguf": draft.name if draft else None}
        try:
            with LlamaCppRunner(target, method, draft_gguf=draft, threads=threads,
                                speculative_tokens=ecfg.num_draft_tokens) as runner:
                for _ in range(ecfg.warmup):
                    runner.complete(requests[0], min(ecfg.warmup_tokens, ecfg.max_new_tokens))
                entry["completions"] = [runner.complete(ids, ecfg.max_new_tokens) for ids in requests]
        except SpecforgeError as err:
            log.error("%s failed: %s", method, err)
            entry["error"] = str(err)
        results[method] = entry
        if "completions" in entry:
            done = entry["completions"]
            log.info("%s: %d answers in %.1f s", method, len(done), sum(c.wall_seconds for c in done))
    return {"xllamacpp": version(), "threads": threads, "target_gguf": target.name, "target_precision": precision,
            "results": results}
