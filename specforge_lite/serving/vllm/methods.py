"""The `vllm_*` evaluate methods at batch 1: the speculative_config a user would pass to serve
each (`speculative_config`) and every method over the stage's requests (`run_methods`), each in
its own vLLM engine (`engine.py`). Measurement at load is `load.py`."""

from __future__ import annotations

import logging
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.drafters.methods import VLLM_METHODS, VLLM_OF, served_drafters
from specforge_lite.serving.vllm.engine import VllmEngine, account_workers, sampling_params
from specforge_lite.serving.vllm.interpreter import engine_kwargs

log = logging.getLogger(__name__)


def speculative_config(name: str, cfg, model=None, tokenizer=None, out: Path | None = None) -> dict | None:
    """The speculative_config a user would pass to serve this method (None: plain)."""
    ecfg = cfg.eval
    k = ecfg.num_draft_tokens
    export_dir = Path(ecfg.vllm.export_dir or Path(cfg.run_dir) / "export")

    def exported(sub: str, stage_hint: str) -> str:
        path = export_dir / sub
        if not (path / "config.json").exists():
            raise SpecforgeError(f"{name} serves {path}, which does not exist: {stage_hint} "
                                 "(or set eval.vllm.export_dir to another run's export folder)")
        return str(path)

    if name == "vllm_plain":
        return None
    served = served_drafters()
    if VLLM_OF.get(name) in served:  # a trained drafter, loaded from its export as a user serves it
        drafter = VLLM_OF[name]
        method, sub, *extra = served[drafter]
        return {"method": method, "model": exported(sub, f"export a {drafter} drafter first"),
                "num_speculative_tokens": k, **(extra[0] if extra else {})}
    if name == "vllm_ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_max": ecfg.ngram_max, "prompt_lookup_min": ecfg.ngram_min}
    if name == "vllm_untrained_draft":  # the same untrained draft model as our `untrained_draft` method
        if ecfg.untrained_draft_path:
            return {"method": "draft_model", "model": ecfg.untrained_draft_path, "num_speculative_tokens": k}
        if model is None:  # a vLLM-only evaluate has no target here to build the draft from
            raise SpecforgeError("vllm_untrained_draft without our engine (vllm_* methods only) needs "
                                 "eval.untrained_draft_path: the draft model's folder or hub id")
        from specforge_lite.targets.surgery import load_untrained_draft

        path = out / "vllm_untrained_draft"
        load_untrained_draft(ecfg, model).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}
    raise SpecforgeError(f"unknown vLLM method {name}; known: {', '.join(VLLM_METHODS)}")


def gpu_runner_problem(methods, has_cuda: bool) -> str | None:
    """The vllm_<drafter> methods whose drafter vLLM runs on its GPU model runner only (the
    drafter package's VLLM_NEEDS_GPU says why), where this machine has no CUDA device."""
    from specforge_lite.drafters.registry import DRAFTERS

    needing = {m: VLLM_OF[m] for m in methods if m in VLLM_OF and getattr(DRAFTERS.get(VLLM_OF[m]), "VLLM_NEEDS_GPU",
                                                                          None)}
    if not needing or has_cuda:
        return None
    why = "; ".join(DRAFTERS[d].VLLM_NEEDS_GPU for d in dict.fromkeys(needing.values()))
    return (f"eval.methods {list(needing)}: {why}, and this machine has no CUDA device; measure "
            f"{', '.join(dict.fromkeys(needing.values()))} with our engine here and serve it on a GPU node")


def run_methods(cfg, methods: list[str], requests: list[list[int]], target, out: Path, seed_of,
                after: dict | None = None, max_num_seqs: int | None = None) -> dict:
    """Every vLLM method over every request (prompt ids of each prompt and turn), batch 1, on
    `target` (`serving.engines.ServedTarget`: the path resolved once by the stage, its config,
    the dtype our engine loads it in, its stop ids, our engine's model and tokenizer or None).
    `after`: {name: f}, f(engine) run in the method's engine after its batch-1 answers (the
    measurement at load, whose `max_num_seqs` the engine then has).

    Returns name -> {"outputs", "load_s", "speculative_config", "vllm_version", "draft_as_read"},
    or {"error": message} for a method vLLM could not load or run (the others still run; the
    engine's `failures` fail the stage once the report is written).
    """
    ecfg, after = cfg.eval, after or {}
    dtype, eos_ids = target.dtype, target.eos_ids
    results = {}
    for name in methods:
        spec = speculative_config(name, cfg, target.model, target.tokenizer, out)
        kwargs = engine_kwargs(target.path, dtype, ecfg.vllm, cfg.seed, spec)
        if name in after and max_num_seqs:
            kwargs["max_num_seqs"] = max_num_seqs
        try:
            with VllmEngine(kwargs, ecfg.vllm, out / "vllm.log") as engine:
                account_workers(engine, target.config, dtype, f"vLLM workers ({name}, tensor_parallel_size="
                                f"{ecfg.vllm.tensor_parallel_size})")
                warm = sampling_params(min(ecfg.warmup_tokens, ecfg.max_new_tokens), ecfg.temperature, ecfg.top_p,
                                       eos_ids, [seed_of("warmup")])
                for _ in range(ecfg.warmup):
                    engine.generate(requests[:1], warm, one_at_a_time=True)
                seeds = [seed_of(i, name) for i in range(len(requests))]
                params = sampling_params(ecfg.max_new_tokens, ecfg.temperature, ecfg.top_p, eos_ids, seeds)
                reply = engine.generate(requests, params, one_at_a_time=True)
                if name in after:
                    after[name](engine)
        except SpecforgeError as err:
            log.error("%s failed: %s", name, err)
            results[name] = {"error": str(err).split("\n--- last lines")[0], "speculative_config": spec}
            continue
        results[name] = {"outputs": reply["outputs"], "load_s": engine.load_s, "speculative_config": spec,
                         "vllm_version": engine.version, "draft_as_read": engine.draft}
        log.info("%s: %d answers in %.1f s (engine load %.1f s)", name, len(requests), reply["seconds"], engine.load_s)
    return results
