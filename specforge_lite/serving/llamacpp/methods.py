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
                check_drafted(method, draft, runner.refusal, None)  # refused at load: nothing to measure
                for _ in range(ecfg.warmup):
                    runner.complete(requests[0], min(ecfg.warmup_tokens, ecfg.max_new_tokens))
                entry["completions"] = [runner.complete(ids, ecfg.max_new_tokens) for ids in requests]
                check_drafted(method, draft, runner.refusal, entry["completions"])
        except SpecforgeError as err:
            log.error("%s failed: %s", method, err)
            entry["error"] = str(err)
        results[method] = entry
        if "completions" in entry:
            done = entry["completions"]
            log.info("%s: %d answers in %.1f s", method, len(done), sum(c.wall_seconds for c in done))
    return {"xllamacpp": version(), "threads": threads, "target_gguf": target.name, "target_precision": precision,
            "results": results}


def check_drafted(method: str, draft, refusal: str | None, completions) -> None:
    """A method whose draft GGUF llama.cpp refused (it then decodes plain, tau 1.00) fails: with
    llama.cpp's own line when it logged one, else because no answer had a single draft token."""
    if draft is None:
        return
    if refusal is not None:
        raise SpecforgeError(f"llama.cpp refused the draft {draft.name} and decoded without it: {refusal}")
    if completions is not None and sum(c.drafted for c in completions) == 0:
        raise SpecforgeError(f"llama.cpp proposed no draft token with {draft.name} in any answer: the draft did "
                             "not run (see llama.cpp's log above)")
