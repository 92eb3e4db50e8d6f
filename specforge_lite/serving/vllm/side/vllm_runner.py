"""vLLM's offline engine behind a JSON-lines pipe; run by the interpreter that has vLLM.

    python vllm_runner.py       (started by specforge_lite.serving.vllm, not by hand)

Standard library and vLLM only: this file runs in an environment that may not have
specforge_lite's dependencies. Protocol, one JSON object per line:

- first line in: {"engine": LLM keyword arguments}; out: {"ok", "load_s", "vllm_version"}
- then {"op": "generate", "prompts": [[token ids], ...], "params": SamplingParams
  keyword arguments, "one_at_a_time": bool}; out: {"ok", "outputs": [{"token_ids",
  "finish_reason", "seconds", "counters"}], "seconds"}. With one_at_a_time each prompt is
  its own `generate` call (batch 1) and carries its own deltas of vLLM's counters
  (spec-decode drafts, draft tokens, accepted tokens and accepted tokens per position,
  engine iterations); otherwise all prompts go in one call (vLLM batches them).
- {"op": "load", "prompts", "params", "concurrency": N}: the prompts decoded with N requests
  in flight (a new one admitted as each finishes; the engine's max_num_seqs must be >= N), the
  engine stepped here (`LLMEngine.step`); out: {"ok", "outputs": [{"token_ids", "finish_reason",
  "start", "first", "end"}] (seconds from the run's start: admitted, first token, finished),
  "seconds" (the whole run), "counters" (their deltas over the run), "most_in_flight"}.
- {"op": "weights"}: out: {"ok", "workers": [{"rank", "layer_bytes", "other_bytes"}]}, the
  bytes of the target's parameters each worker holds (decoder layers apart from the rest),
  read inside the workers (`LLM.apply_model` with specforge_lite_vllm_probe.held_weights, a
  module of this folder, which vllm_engine puts on the workers' PYTHONPATH so that the
  function travels to them by name): what a rehearsal checks against each rank's share.
- {"op": "close"}: exit.

Replies go to the process's original stdout; everything else (vLLM's logs, its
workers' output) is sent to stderr so it cannot corrupt a reply.
"""

import json
import os
import sys
import time
import traceback

# run as a script, this file's folder heads sys.path: it holds only this runner and
# specforge_lite_vllm_probe, names that shadow no package

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
}


def read_counters(llm) -> dict:
    """vLLM's cumulative counters we read: spec decode, tokens, engine iterations."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": [],
           "generation_tokens": 0, "prompt_tokens": 0, "iterations": 0}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = list(metric.values)
            old = out["accepted_per_position"]
            out["accepted_per_position"] = [a + b for a, b in zip(values, old + [0] * len(values))]
        elif metric.name == "vllm:iteration_tokens_total":  # a histogram with one entry per engine step
            out["iterations"] += metric.count
    return out


def delta(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            old = before[key] + [0] * (len(value) - len(before[key]))
            out[key] = [a - b for a, b in zip(value, old)]
        else:
            out[key] = value - before[key]
    return out


def generate(llm, request: dict) -> dict:
    from vllm import SamplingParams

    prompts = request["prompts"]
    params = request["params"]
    seeds = params.pop("seeds", None)  # one seed per prompt (sampling), so results do not depend on batching

    def params_for(i):
        return SamplingParams(**params, seed=None if seeds is None else seeds[i])

    def pack(output, seconds=None, counters=None):
        completion = output.outputs[0]
        return {"token_ids": list(completion.token_ids), "finish_reason": completion.finish_reason,
                "seconds": seconds, "counters": counters}

    started = time.perf_counter()
    if request.get("one_at_a_time"):
        outputs = []
        for i, ids in enumerate(prompts):
            before = read_counters(llm)
            t0 = time.perf_counter()
            (output,) = llm.generate([{"prompt_token_ids": ids}], params_for(i), use_tqdm=False)
            seconds = time.perf_counter() - t0
            outputs.append(pack(output, seconds, delta(read_counters(llm), before)))
    else:
        results = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                               [params_for(i) for i in range(len(prompts))], use_tqdm=False)
        outputs = [pack(o) for o in results]
    return {"ok": True, "outputs": outputs, "seconds": time.perf_counter() - started}


def load(llm, request: dict) -> dict:
    """The prompts with `concurrency` requests in flight, each admitted as an earlier one finishes:
    the load a server with that many concurrent clients sees (see the module docstring)."""
    from vllm import SamplingParams

    prompts, params, width = request["prompts"], dict(request["params"]), int(request["concurrency"])
    seeds = params.pop("seeds", None)
    engine = llm.llm_engine
    waiting, live = list(range(len(prompts))), set()
    rows = [None] * len(prompts)
    before = read_counters(llm)
    started = time.perf_counter()
    most = 0

    def admit():
        i = waiting.pop(0)
        seed = None if seeds is None else seeds[i]
        engine.add_request(f"{i}", {"prompt_token_ids": prompts[i]}, SamplingParams(**params, seed=seed))
        rows[i] = {"start": time.perf_counter() - started, "first": None}
        live.add(i)

    while waiting or live:
        while waiting and len(live) < width:
            admit()
        most = max(most, len(live))
        outputs = engine.step()
        now = time.perf_counter() - started
        for output in outputs:
            i = int(str(output.request_id).split("-")[0])  # vLLM may add a suffix of its own
            completion = output.outputs[0] if output.outputs else None
            if completion is not None and completion.token_ids and rows[i]["first"] is None:
                rows[i]["first"] = now
            if output.finished and i in live:
                live.discard(i)
                rows[i].update(end=now, token_ids=list(completion.token_ids) if completion else [],
                               finish_reason=completion.finish_reason if completion else None)
    seconds = time.perf_counter() - started
    return {"ok": True, "outputs": rows, "seconds": seconds, "counters": delta(read_counters(llm), before),
            "most_in_flight": most}


def draft_as_read(llm):
    """What vLLM read of the drafter's config: the target layers whose hidden states it feeds the
    drafter (EAGLE-3's ids, DFlash's target layers shifted as vLLM counts them) and the drafter
    class it built; None without a drafter model (plain, ngram) or where this vLLM keeps it elsewhere."""
    try:
        spec = llm.llm_engine.vllm_config.speculative_config
        hf_config = spec.draft_model_config.hf_config if spec is not None and spec.draft_model_config else None
    except AttributeError:
        return None
    if hf_config is None:
        return None
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    dflash = getattr(hf_config, "dflash_config", None)
    if not ids and isinstance(dflash, dict):
        ids = [i + 1 for i in dflash.get("target_layer_ids") or []]
    return {"aux_hidden_state_layer_ids": list(ids) if ids else None,
            "architectures": list(getattr(hf_config, "architectures", None) or [])}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # from here on, anything printed (by vLLM or its workers) goes to stderr
    sys.stdout = sys.stderr

    def reply(obj):
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    try:
        first = json.loads(sys.stdin.readline())
        import vllm
        from vllm import LLM

        started = time.perf_counter()
        llm = LLM(**first["engine"])
        reply({"ok": True, "load_s": time.perf_counter() - started, "vllm_version": vllm.__version__,
               "draft": draft_as_read(llm)})
    except Exception as err:  # noqa: BLE001  reported to the parent, which raises it
        reply({"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        return
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "close":
            break
        try:
            if request.get("op") == "weights":
                from specforge_lite_vllm_probe import held_weights  # importable in vLLM's workers too

                reply({"ok": True, "workers": sorted(llm.apply_model(held_weights), key=lambda w: w["rank"])})
                continue
            reply(load(llm, request) if request.get("op") == "load" else generate(llm, request))
        except Exception as err:  # noqa: BLE001
            reply({"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})


if __name__ == "__main__":  # vLLM's CPU backend spawns its worker, which re-imports this file
    main()
