"""One validation pass over the composed config, before any stage loads anything.

Hydra's typed schema already rejects an unknown key and a value of the wrong type. This
pass adds what a type cannot say:

- the ranges and allowed values declared next to each field (`config.checked`, dataclass
  field metadata), walked over whatever dataclass each config node was built from, so a
  new options dataclass is covered by declaring its rules;
- keys that are not in the schema: `+key=value` adds a key past Hydra's struct check, and
  a key that nothing reads is a setting silently ignored;
- a few rules between fields (`cross_field_problems`);
- once the target's own HF config is known (`validate_config(cfg, target_config)`), the
  fields bounded by it (`below_target`, such as `drafter.aux_layer_ids` against its depth),
  and what its family can run (`eval.engine`, `untrained_draft`).

Every problem names the key, the value given and what is allowed; all are reported at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.run_folders import STAGE_DIRS, folder_problem, samples_dir
from specforge_lite.stage_table import COMMANDS, SAMPLE, runs
from specforge_lite.data.eval_prompts import dataset_problem
from specforge_lite.drafters.methods import length_problems, method_problems, tree_problems
from specforge_lite.serving.engines import ENGINES
from specforge_lite.serving.vllm.load import concurrency_problems
from specforge_lite.drafters.registry import DRAFTERS, sglang_refusal
from specforge_lite.runtime.compile import autotune, gemm_rows
from specforge_lite.scale.launch import num_processes
from specforge_lite.scale.sizing import batch_choice
from specforge_lite.training.throughput import peak_tflops


def check_at_the_door(cfg: DictConfig) -> Any:
    """The door, once per command, before anything is loaded, launched or written: the whole
    config, then (a dry run) against the target's config alone, which it returns, or
    (`validate_for_target`) this machine's folders and packages and the target's own config."""
    validate_config(cfg)
    if cfg.dry_run:  # nothing will be loaded: the target's config is all a dry run reads
        from specforge_lite.targets.loading import sizing_config

        target_config = sizing_config(cfg.target.path)
        validate_config(cfg, target_config)
        return target_config
    validate_for_target(cfg)
    return None


def validate_config(cfg: DictConfig, target_config: Any = None) -> None:
    """Raise one `SpecforgeError` listing every problem of `cfg` (see the module docstring)."""
    refuse(config_problems(cfg, target_config))


def refuse(problems: list[str]) -> None:
    if problems:
        head = "invalid setting" if len(problems) == 1 else f"{len(problems)} invalid settings"
        raise SpecforgeError((f"{head}: " + problems[0]) if len(problems) == 1
                             else f"{head}:\n" + "\n".join(f"  {p}" for p in problems))


def config_problems(cfg: DictConfig, target_config: Any = None) -> list[str]:
    problems: list[str] = []
    _walk(cfg, "", problems, target_config)
    for setting in (gemm_rows, autotune):  # environment settings the compiled forwards read
        try:
            setting()
        except ValueError as error:
            problems.append(str(error))
    if not problems:  # cross-field rules assume every single value is sane
        problems += cross_field_problems(cfg)
        for engine in ENGINES:  # each serving engine's own settings (llama.cpp: export.gguf, draft GGUFs)
            problems += engine.config_problems(cfg, target_config)
    return problems


def validate_for_target(cfg: DictConfig) -> None:
    """The second pass, before a stage writes anything: the folders and packages of this
    machine the stage needs (`environment_problems`); the target's folder is checked (its
    config.json and weight files, by name) and its config read; the stages that build a
    drafter then check the fields bounded by it (such as aux layer ids against its depth), and
    the stages that evaluate what its family can run (`engine_problem`)."""
    refuse(environment_problems(cfg))  # this machine's folders and packages, as the config needs them
    if runs(cfg.stage, "evaluate"):  # the prompt set, before `run` samples and trains
        refuse([p for p in (dataset_problem(cfg),) if p])
    if cfg.stage == "train" and cfg.train.dry_run:  # reads only the config it sizes, never weights
        from specforge_lite.targets.loading import sizing_config

        validate_config(cfg, sizing_config(cfg.target.path))  # the fields bounded by it (aux layer ids)
        return
    refuse(training_problems(cfg))  # before the target's config is read (a hub id a sharded target cannot take)
    from specforge_lite.targets.loading import load_target_config, resolve_target_path

    # export reads only the embeddings, final norm and lm_head (target_head.py checks their files)
    target_config = load_target_config(cfg.target, weights=cfg.stage != "export")
    if COMMANDS[cfg.stage].builds_drafter:  # checked against the target's config
        validate_config(cfg, target_config)
    if runs(cfg.stage, "evaluate"):  # what the target's family runs, a tree's budget and the answers' length
        family = [engine_problem(cfg.eval, target_config)]
        refuse([p for p in family if p] + tree_problems(cfg.eval, target_config)
                + length_problems(cfg.eval, target_config))
    # the other models a stage will load: paths resolved now (a missing one fails at once)
    if COMMANDS[cfg.stage].builds_drafter and cfg.drafter.get("student"):
        resolve_target_path(cfg.drafter.student, "drafter.student")
    if runs(cfg.stage, "evaluate") and cfg.eval.untrained_draft_path and \
            {"untrained_draft", "hf_assisted"} & set(cfg.eval.methods):
        resolve_target_path(cfg.eval.untrained_draft_path, "eval.untrained_draft_path")


def engine_problem(eval_cfg: DictConfig, target_config: Any) -> str | None:
    """`eval.engine` against the target's family: static and compiled are our own forward,
    which covers only some families (`static_llama.unsupported_reason`); refused here, before
    sample and train, rather than when evaluate builds the forward after them."""
    from specforge_lite.runtime.hf_runner import cache_problem, rollback_problem
    from specforge_lite.runtime.static_llama import unsupported_reason

    kind = getattr(target_config, "model_type", None)
    # every method of ours and of transformers' generate builds transformers' cache for the target
    ours = [m for m in eval_cfg.methods if not m.startswith(("vllm", "llamacpp"))]
    broken = cache_problem(target_config) if ours else None
    if broken:
        return (f"eval.methods={ours}: model_type {kind!r} cannot run them on transformers' forward: {broken}; "
                "evaluate it with vLLM's methods (vllm_*), or with a transformers that knows the layer type")
    # our decoder and transformers' assisted generation crop the target's cache after a rejection
    drafting = [m for m in ours if m not in ("plain", "hf_generate")]
    stuck = rollback_problem(target_config) if drafting else None
    if stuck:
        return (f"eval.methods={drafting}: model_type {kind!r} cannot run them on our decoder: {stuck}; evaluate "
                "it with eval.methods=[plain,hf_generate] or with vLLM's methods (vllm_*)")
    reason = unsupported_reason(target_config)
    if eval_cfg.engine not in ("static", "compiled") or not reason:
        return None
    what = reason if reason.startswith("model_type") else f"model_type {kind!r} with {reason}"
    return (f"eval.engine={eval_cfg.engine}: the static forward does not support {what}; "
            "eval.engine=hf runs this target on transformers' forward (auto chooses it)")


def _walk(node: DictConfig, prefix: str, problems: list[str], target_config: Any) -> None:
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in fields and not (prefix == "" and key == "hydra"):
            hint = difflib.get_close_matches(str(key), list(fields), n=1)
            problems.append(f"{prefix}{key}={_shown(node, key)}: unknown key ({schema.__name__} has no such field"
                            + (f"; did you mean {prefix}{hint[0]}?" if hint else "") + ")")
    for name, spec in fields.items():
        full = f"{prefix}{name}"
        if name not in node:
            continue
        if OmegaConf.is_missing(node, name):
            problems.append(f"{full} is not set; give it on the command line ({full}=...)")
            continue
        try:
            value = node[name]
        except Exception as err:  # an interpolation that does not resolve: omegaconf's first line
            problems.append(f"{full}: cannot resolve its value ({str(err).splitlines()[0]})")
            continue
        if isinstance(value, DictConfig):
            _walk(value, f"{full}.", problems, target_config)
        elif spec.metadata and _applies(node, spec.metadata.get("when")):
            problem = check_value(full, _plain(value), spec.metadata, target_config)
            if problem:
                problems.append(problem)


def _shown(node: DictConfig, key: str) -> str:
    try:
        return str(_plain(node[key]))
    except Exception:
        return "..."


def _plain(value: Any) -> Any:
    if isinstance(value, ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return getattr(value, "value", value)  # enums compare by their value


def _applies(node: DictConfig, when: dict | None) -> bool:
    """`when`: sibling values under which a field's rules apply (a missing sibling: they apply)."""
    return all(key not in node or _plain(node[key]) == value for key, value in (when or {}).items())


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_value(key: str, value: Any, rules: dict, target_config: Any = None) -> str | None:
    """The first rule `value` breaks, as a message naming `key`, the value and what is allowed."""
    if value is None:
        return None
    shown = f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
    if "choices" in rules and value not in rules["choices"]:
        return f"{shown}: choose one of {', '.join(map(str, rules['choices']))}"
    if "pattern" in rules and not (isinstance(value, str) and re.fullmatch(rules["pattern"], value)):
        return f"{shown}: allowed: {rules.get('allowed', rules['pattern'])}"
    if "length" in rules and isinstance(value, list) and len(value) != rules["length"]:
        return f"{shown}: needs exactly {rules['length']} values, got {len(value)}"
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not _number(item):
            continue
        for rule, ok, says in (("ge", item >= rules.get("ge", item), ">="), ("gt", "gt" not in rules
                               or item > rules["gt"], ">"), ("le", item <= rules.get("le", item), "<="),
                               ("lt", "lt" not in rules or item < rules["lt"], "<")):
            if rule in rules and not ok:
                note = f" ({rules['note']})" if "note" in rules else ""
                return f"{shown}: {'every value must be' if isinstance(value, list) else 'must be'} " \
                       f"{says} {rules[rule]}{note}"
        bound = rules.get("below_target")
        if bound and target_config is not None and getattr(target_config, bound, None) is not None:
            limit = getattr(target_config, bound)
            if item >= limit:
                return (f"{shown}: the target has {bound}={limit}, so "
                        f"{'every value' if isinstance(value, list) else 'it'} must be below {limit}")
    return None


# --------------------------------------------------------------------------- folders and packages

def environment_problems(cfg: DictConfig) -> list[str]:
    """What the folders and installed packages a stage needs say, before it does any work:
    $SPECFORGE_LITE_CACHE, the stage folders under run_dir (a file where one goes), vLLM for
    the vllm_* methods and the vllm sample backend, an SGLang layout for `export.sglang=true`."""
    from specforge_lite.targets.loading import CACHE_ENV, cache_root

    problems = []
    if os.environ.get(CACHE_ENV) is not None:
        try:
            problems.append(folder_problem(cache_root(), CACHE_ENV))
        except SpecforgeError as err:
            problems.append(str(err))
    for written in COMMANDS[cfg.stage].writes:  # the stage folders it writes (stage_table.py)
        own = written == SAMPLE.name and cfg.get("samples_dir")
        folder = samples_dir(cfg) if written == SAMPLE.name else Path(cfg.run_dir) / STAGE_DIRS[written]
        problems.append(folder_problem(folder, "samples_dir" if own else "run_dir"))
    for engine in ENGINES:  # what each serving engine needs installed (vLLM's interpreter)
        problems += engine.environment_problems(cfg)
    if cfg.stage == "run" and cfg.export.sglang and (problem := sglang_refusal(cfg.drafter.name)
                                                     or sglang_options_problem(cfg.drafter)):
        problems.append(f"export.sglang=true with drafter={cfg.drafter.name}: {problem}")
    if runs(cfg.stage, "train") and runs(cfg.stage, "evaluate"):  # `run`: the drafters its methods read
        problems += untrained_kinds(cfg)
    return [p for p in problems if p]


def sglang_options_problem(drafter_cfg: DictConfig) -> str | None:
    """What the drafter's options ask that SGLang's layout cannot hold (EAGLE-3's switches); None where
    `drafter.init_from` decides the architecture (known once it is read) or the kind has no such rule."""
    rule = getattr(DRAFTERS.get(str(drafter_cfg.name)), "sglang_problem", None)
    return None if rule is None or drafter_cfg.get("init_from") else rule(drafter_cfg)


def untrained_kinds(cfg: DictConfig) -> list[str]:
    """`run` trains `drafter`: a method of another trained drafter kind needs its folder named."""
    from specforge_lite.drafters.methods import trained_kinds

    return [f"eval.methods needs a trained {kind} drafter, and this run trains drafter={cfg.drafter.name}: set "
            f"eval.drafter_dirs.{kind} to a {kind} drafter's folder, or leave its methods out"
            for kind in trained_kinds(cfg.eval.methods) if kind != cfg.drafter.name and not cfg.eval.drafter_dirs.get(kind)]


# --------------------------------------------------------------------------- the training's layout

def training_problems(cfg: DictConfig) -> list[str]:
    """For the stages that train: a sharded target's path must be a local directory (its
    safetensors files are read by name), and `train.tokens_per_step` must fit the ranks and the
    devices this process sees (scale/sizing.py `batch_choice`)."""
    if not COMMANDS[cfg.stage].builds_drafter:
        return []
    path = str(cfg.target.path)
    if cfg.trainer.shard_target and not path.startswith("builtin:") and not Path(path).expanduser().is_dir():
        return [f"trainer.shard_target=true reads the target's safetensors files from a local directory, and "
                f"target.path={path!r} is none: download it first (huggingface-cli download {path} --local-dir "
                f"DIR) and give target.path=DIR"]
    world = int(os.environ.get("WORLD_SIZE") or num_processes(cfg) * cfg.trainer.num_nodes)
    try:
        batch_choice(cfg, world)
    except SpecforgeError as err:
        return [str(err)]
    return []


# --------------------------------------------------------------------------- rules between fields

def temperature_problems(value) -> list[str]:
    """eval.temperature: a number >= 0, or a list of them without repeats (each measured whole)."""
    many = isinstance(value, (list, tuple, ListConfig))
    items = list(value) if many else [value]
    shown = list(items) if many else value
    if many and not items:
        return ["eval.temperature=[]: give a temperature (0: greedy) or a list of them"]
    if any(isinstance(t, bool) or not isinstance(t, (int, float)) for t in items):
        return [f"eval.temperature={shown}: must be a number >= 0 (0: greedy) or a list of them"]
    if len(set(map(float, items))) != len(items):
        return [f"eval.temperature={shown} repeats a temperature"]
    return []


def cross_field_problems(cfg: DictConfig) -> list[str]:
    """Rules no single field can state."""
    problems = []
    sample, ecfg, tcfg = cfg.sample, cfg.eval, cfg.train
    if sample.rank is not None and sample.world_size is not None and sample.rank >= sample.world_size:
        problems.append(f"sample.rank={sample.rank} with sample.world_size={sample.world_size}: "
                        "the rank must be below the world size")
    for key, vcfg in (("sample.vllm", sample.vllm), ("eval.vllm", ecfg.vllm)):
        if vcfg.single_process and vcfg.tensor_parallel_size > 1:
            problems.append(f"{key}.single_process=true runs one worker: {key}.tensor_parallel_size="
                            f"{vcfg.tensor_parallel_size} needs it false (or null)")
    if ecfg.ngram_min > ecfg.ngram_max:
        problems.append(f"eval.ngram_min={ecfg.ngram_min} is above eval.ngram_max={ecfg.ngram_max}")
    problems += method_problems(ecfg)
    problems += concurrency_problems(ecfg) + temperature_problems(ecfg.temperature)
    init_from = cfg.drafter.get("init_from")
    if init_from:
        from pathlib import Path

        if not Path(init_from).is_dir():
            problems.append(f"drafter.init_from={init_from!r}: no such folder")
    if tcfg.feature_format == "int4_topk" and DRAFTERS[str(cfg.drafter.name)].READS_LAST_HIDDEN:
        problems.append(f"train.feature_format=int4_topk stores the teacher instead of the last hidden state, which "
                        f"drafter {cfg.drafter.name} reads: use bf16, int8 or int4")
    elif tcfg.feature_format == "int4_topk" and (cfg.drafter.get("draft_vocab_size") or 0) > 2 ** 15:
        problems.append(f"train.feature_format=int4_topk stores draft ids as int16: drafter.draft_vocab_size="
                        f"{cfg.drafter.draft_vocab_size} is above {2 ** 15}; use int4 or a smaller draft vocab")
    try:  # the MFU estimate's device peak: a number or a GPU of the table
        peak_tflops(tcfg.peak_tflops)
    except SpecforgeError as err:
        problems.append(str(err))
    if tcfg.tokens_per_step not in (None, "auto") and int(tcfg.tokens_per_step.replace("_", "")) < cfg.data.max_length:
        problems.append(f"train.tokens_per_step={tcfg.tokens_per_step} is below one sequence of data.max_length="
                        f"{cfg.data.max_length}: give at least {cfg.data.max_length} (or auto)")
    if not tcfg.use_samples and tcfg.source_conversations == 0:
        problems.append("train.use_samples=false with train.source_conversations=0 leaves nothing to train on: "
                        "set train.source_conversations > 0")
    strategy = getattr(cfg.trainer.strategy, "value", cfg.trainer.strategy)
    if tcfg.optimizer == "muon" and strategy != "ddp":
        problems.append(f"train.optimizer=muon orthogonalises whole weight matrices, which trainer.strategy={strategy} "
                        "shards over ranks: use trainer.strategy=ddp (or train.optimizer=adamw)")
    if cfg.trainer.deepspeed_config and strategy.startswith("deepspeed"):
        from pathlib import Path

        if not Path(cfg.trainer.deepspeed_config).is_file():
            problems.append(f"trainer.deepspeed_config={cfg.trainer.deepspeed_config!r}: no such file")
    from specforge_lite.data.formats import format_problem  # a source not of data.format: before `run` samples
    problems += [p for p in (format_problem(str(cfg.data.source), str(cfg.data.format)),) if p]
    for key in ("target.path", "data.source", "eval.dataset", "run_dir"):
        if not str(OmegaConf.select(cfg, key)).strip():
            problems.append(f"{key} is empty")
    return problems
