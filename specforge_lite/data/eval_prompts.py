"""Evaluation prompt sets: MT-Bench, ShareGPT's held-out task areas, a prompts file, or the
held-out conversations of the training source, as `{"id", "category", "system", "turns": [...]}`."""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from specforge_lite import SpecforgeError
from specforge_lite.checked_io import read_json_object
from specforge_lite.run_folders import samples_dir
from specforge_lite.config.draft_tokens import widest_k
from specforge_lite.data.chat import prompt_ids
from specforge_lite.data.readers import (MT_BENCH_MEMBER, SHAREGPT_MEMBER, BadRecord, ReadStats, heldout_split,
                                         iter_json_array, iter_jsonl, package_file, read_conversations)

log = logging.getLogger(__name__)


def load_prompts(cfg: DictConfig) -> list[dict]:
    """Eval prompts as {"id", "category", "system", "turns": [user message, ...]}."""
    dataset = cfg.eval.dataset
    if dataset == SHAREGPT_TASKS:
        prompts = read_task_prompts(cfg)
    elif dataset != "heldout":
        prompts = [{**p, "system": None} for p in read_eval_prompts(dataset, cfg.data.strict)]
    else:
        records, _ = read_conversations(cfg.data.source, cfg.data.format, cfg.data.strict)
        split = samples_dir(cfg) / "split.json"
        if split.exists():
            ids = set(read_json_object(split, required=("heldout_ids",))["heldout_ids"])
            heldout = [r for r in records if r["id"] in ids]
            if ids and not heldout:
                raise SpecforgeError(f"none of the held-out ids in {split} are in {cfg.data.source}: "
                                     "was the data source changed after the sample stage?")
        else:
            log.warning("%s not found (sample stage not run); splitting %s with data.heldout_fraction=%s",
                        split, cfg.data.source, cfg.data.heldout_fraction)
            _, heldout = heldout_split(records, cfg.data.heldout_fraction, cfg.data.split_seed)
        prompts = [record_prompt(record, "heldout") for record in heldout]
    if not prompts:
        raise SpecforgeError(f"eval.dataset={dataset} gave no prompts")
    prompts = unique_ids(prompts, dataset, cfg.data.strict)
    if cfg.eval.max_turns is not None:
        prompts = [{**p, "turns": p["turns"][:cfg.eval.max_turns]} for p in prompts]
    return prompts


SHAREGPT_TASKS = "builtin:sharegpt_tasks"
TASKS_FILE = Path(__file__).resolve().parent.parent / "assets" / "sharegpt_tasks.json"
BUILTIN_SETS = ("builtin:mt_bench", SHAREGPT_TASKS)  # `heldout` besides: the training source's held-out side
PROMPT_SUFFIXES = (".jsonl", ".json")


def dataset_problem(cfg: DictConfig) -> str | None:
    """What is wrong with `eval.dataset` before any stage runs (the door): an unknown built-in
    set, a prompts file that is missing or of another kind, or ShareGPT task prompts that this
    run's split would train on (decided by their ids alone, as `heldout_split` does)."""
    dataset = str(cfg.eval.dataset)
    if dataset == "heldout":
        return heldout_problem(cfg)
    if dataset == "builtin:mt_bench":
        return None
    if dataset == SHAREGPT_TASKS:
        return tasks_overlap(cfg)
    if dataset.startswith("builtin:"):
        return f"eval.dataset={dataset!r}: no such built-in prompt set; known: heldout, {', '.join(BUILTIN_SETS)}"
    path = Path(dataset).expanduser()
    if not path.exists():
        return f"eval.dataset={dataset!r}: no such file (give a .jsonl or .json prompts file, or one of heldout, " \
               f"{', '.join(BUILTIN_SETS)})"
    if not path.is_file():
        return f"eval.dataset={dataset!r} is not a file"
    if path.suffix not in PROMPT_SUFFIXES:
        return f"eval.dataset={dataset!r}: expected a .jsonl (or .json) file of prompts"
    try:  # a prompts file is small: read now, so that `run` does not sample and train first
        usable = read_eval_prompts(dataset, cfg.data.strict)
    except SpecforgeError as err:
        return str(err)
    if not usable:
        return (f"eval.dataset={dataset!r} holds no usable prompt (each record needs `turns`, a list of non-empty "
                "strings, or `prompt`, a string; the warning above counts what was skipped)")
    return None


def heldout_problem(cfg: DictConfig) -> str | None:
    """`eval.dataset=heldout` with `data.heldout_fraction=0` holds nothing out: refused where this
    command samples (its split.json will be empty) or no earlier sample stage wrote a split."""
    from specforge_lite.stage_table import runs

    if cfg.data.heldout_fraction > 0:
        return None
    split = samples_dir(cfg) / "split.json"
    if not runs(cfg.stage, "sample") and split.exists():
        return None  # the held-out ids the sample stage recorded (load_prompts reads them)
    return ("eval.dataset=heldout with data.heldout_fraction=0 holds no conversation out of training: give "
            "data.heldout_fraction > 0 (such as 0.02) or another eval.dataset (builtin:mt_bench)")


def tasks_overlap(cfg: DictConfig) -> str | None:
    """The refusal of `builtin:sharegpt_tasks` where this run's split trains on some of its prompts."""
    spec = read_json_object(TASKS_FILE, required=("source", "split", "prompts"))
    if cfg.data.source != spec["source"]:
        return None
    train, _ = heldout_split([{"id": p["id"]} for p in spec["prompts"]], cfg.data.heldout_fraction, cfg.data.split_seed)
    if not train:
        return None
    split = spec["split"]
    return (f"eval.dataset={SHAREGPT_TASKS}: {len(train)} of its {len(spec['prompts'])} prompts are on the training "
            f"side of this run's split (data.split_seed={cfg.data.split_seed}, data.heldout_fraction="
            f"{cfg.data.heldout_fraction}); they were picked from the held-out side at data.split_seed="
            f"{split['split_seed']}, data.heldout_fraction={split['heldout_fraction']}: use those, or another eval.dataset")


def read_task_prompts(cfg: DictConfig) -> list[dict]:
    """`builtin:sharegpt_tasks`: the first user turn of the ShareGPT conversations that
    assets/sharegpt_tasks.json names, each with its task area as its category. They were picked
    from the held-out side of the default split; a run whose own split would train on one of
    them (data.source is ShareGPT with another data.split_seed or a smaller
    data.heldout_fraction) is refused, since its drafter may have seen them."""
    spec = read_json_object(TASKS_FILE, required=("source", "split", "prompts"))
    records, _ = read_conversations(spec["source"], "auto", cfg.data.strict)
    by_id = {r["id"]: r for r in records}
    missing = [p["id"] for p in spec["prompts"] if p["id"] not in by_id]
    if missing:
        raise SpecforgeError(f"eval.dataset={SHAREGPT_TASKS}: {len(missing)} of its conversations are not in the "
                             f"installed ShareGPT file ({', '.join(missing[:3])}); reinstall it with:\n  "
                             f"{SHAREGPT_MEMBER[2]}")
    picked = [by_id[p["id"]] for p in spec["prompts"]]
    overlap = tasks_overlap(cfg)
    if overlap:  # the door said so already; a config built in code meets it here
        raise SpecforgeError(overlap)
    prompts = [record_prompt(record, entry["category"]) for entry, record in zip(spec["prompts"], picked)]
    return [{**prompt, "turns": prompt["turns"][:1]} for prompt in prompts]


def record_prompt(record: dict, category: str) -> dict:
    """An eval prompt from a conversation record: its system message, its user turns in order."""
    messages = record["messages"]
    return {"id": record["id"], "category": category,
            "system": messages[0]["content"] if messages[0]["role"] == "system" else None,
            "turns": [m["content"] for m in messages if m["role"] == "user"]}


def unique_ids(prompts: list[dict], source: str, strict: bool = False) -> list[dict]:
    """`prompts` with every id unique: a repeated id becomes `ID#2`, `ID#3`, ... and the renames
    are counted in a warning (`strict`: the first repeat is an error naming it). Statistics are
    keyed on prompt ids: merged, two prompts would count as one."""
    seen: set[str] = {p["id"] for p in prompts}
    counts: dict[str, int] = defaultdict(int)
    renamed, out = [], []
    for prompt in prompts:
        counts[prompt["id"]] += 1
        if counts[prompt["id"]] == 1:
            out.append(prompt)
            continue
        if strict:
            raise SpecforgeError(f"eval.dataset {source}: prompt id {prompt['id']!r} appears more than once")
        n = counts[prompt["id"]]
        while f"{prompt['id']}#{n}" in seen:
            n += 1
        new_id = f"{prompt['id']}#{n}"
        seen.add(new_id)
        renamed.append(f"{prompt['id']} -> {new_id}")
        out.append({**prompt, "id": new_id})
    if renamed:
        more = f" and {len(renamed) - 5} more" if len(renamed) > 5 else ""
        log.warning("eval.dataset %s: %d prompt(s) had an id used before and were renamed (%s%s)", source,
                    len(renamed), ", ".join(renamed[:5]), more)
    return out


def select_prompts(prompts: list[dict], max_prompts: int | None) -> list[dict]:
    """The first `max_prompts` in round-robin order over categories, in source order."""
    if max_prompts is None or max_prompts >= len(prompts):
        return prompts
    by_category: dict[str, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        by_category[prompt["category"]].append(i)
    picked: list[int] = []
    queues = list(by_category.values())
    while len(picked) < max_prompts:
        for queue in queues:
            if queue and len(picked) < max_prompts:
                picked.append(queue.pop(0))
    return [prompts[i] for i in sorted(picked)]


def read_eval_prompts(source: str, strict: bool = False) -> list[dict[str, Any]]:
    """Evaluation prompts as `{"id", "category", "turns": [user message, ...]}`.

    `builtin:mt_bench` reads the 80 MT-Bench questions; a `.jsonl` file (or a `.json` array)
    takes records with `turns` (a list of non-empty strings) or `prompt` (one string), and
    optional `category` (a string) and `id`. Bad records are skipped and counted by reason
    like training data (`strict`: the first one is an error naming file and record).
    """
    if source == "builtin:mt_bench":
        path = package_file(MT_BENCH_MEMBER)
    elif source.startswith("builtin:"):
        raise SpecforgeError(f"eval.dataset={source!r}: no such built-in prompt set; known: heldout, "
                             f"{', '.join(BUILTIN_SETS)}")
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise SpecforgeError(f"eval.dataset {source!r} does not exist" if not path.exists()
                                 else f"eval.dataset {source!r} is not a file")
    stats = ReadStats(source=source)
    if path.suffix == ".json":
        raw_iter = iter_json_array(path, stats, strict)
    elif path.suffix == ".jsonl":
        raw_iter = iter_jsonl(path, stats, strict)
    else:
        raise SpecforgeError(f"eval.dataset {source!r}: expected a .jsonl (or .json) file of prompts")
    prompts = []
    for index, raw in raw_iter:
        try:
            prompts.append(eval_prompt(raw, fallback_id=str(index)))
        except BadRecord as bad:
            if strict:
                raise SpecforgeError(f"{path}: record {index}: {bad.reason}: {bad}") from None
            stats.skipped[bad.reason] += 1
    stats.recovered = len(prompts)
    if stats.num_skipped:
        log.warning("%s", stats.summary())
    return prompts


def eval_prompt(raw: Any, fallback_id: str) -> dict[str, Any]:
    """One raw evaluation prompt record to `{"id", "category", "turns"}`."""
    if not isinstance(raw, dict):
        raise BadRecord("not_an_object", "record is not a JSON object")
    if "turns" in raw:
        turns = raw["turns"]
        if not isinstance(turns, list):
            raise BadRecord("turns_not_a_list", f"'turns' is a {type(turns).__name__}, not a list of strings")
    elif "prompt" in raw:
        turns = [raw["prompt"]]
    else:
        raise BadRecord("missing_key", "record has neither 'turns' nor 'prompt'")
    if not turns:
        raise BadRecord("empty_conversation", "no turns")
    for i, turn in enumerate(turns):
        if not isinstance(turn, str):
            raise BadRecord("non_string_turn", f"turn {i} is {type(turn).__name__}, not a string")
        if not turn.strip():
            raise BadRecord("empty_turn", f"turn {i} is empty")
    category = raw.get("category", "all")
    if not isinstance(category, str):
        raise BadRecord("non_string_category", f"category is {type(category).__name__}, not a string")
    record_id = raw.get("question_id", raw.get("id", fallback_id))
    return {"id": str(record_id), "category": category, "turns": list(turns)}


# --------------------------------------------------------------------------- conversations

def positions_needed(tokenizer, prompt: dict, ecfg) -> int:
    """Positions one prompt's conversation can take: its user turns, each answer's
    max_new_tokens plus room for re-tokenising it in the next turn, one verification's k + 1
    (or a tree's nodes + 1, `eval.tree`)."""
    turns = len(prompt["turns"])
    ids = prompt_ids(tokenizer, conversation(prompt, [""] * (turns - 1), turns - 1))
    widest = max(widest_k(ecfg), ecfg.tree.nodes if ecfg.get("tree") else 0)
    return len(ids) + turns * (ecfg.max_new_tokens + 16) + widest + 1


def fitting_prompts(tokenizer, prompts: list[dict], ecfg, config) -> tuple[list[dict], list[str]]:
    """The prompts whose conversation fits the target's context (max_position_embeddings), and
    the ids of those skipped for it (counted in the report, as the sample stage counts its own)."""
    context = getattr(config, "max_position_embeddings", None)
    if not context:
        return prompts, []
    kept = [p for p in prompts if positions_needed(tokenizer, p, ecfg) <= context]
    skipped = [p["id"] for p in prompts if p not in kept]
    if not kept:
        raise SpecforgeError(f"eval.dataset={ecfg.dataset}: every prompt is longer than the target's context of "
                             f"{context} positions (with eval.max_new_tokens={ecfg.max_new_tokens} per turn)")
    if skipped:
        log.warning("skipped %d of %d eval prompts longer than the target's context of %d positions (with "
                    "eval.max_new_tokens=%d per turn): %s", len(skipped), len(prompts), context,
                    ecfg.max_new_tokens, ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    return kept, skipped


def conversation(prompt: dict, replies: list[str], turn: int) -> list[dict]:
    """The chat messages of turn `turn` (0-based): the system prompt, the earlier user turns with
    `replies` as the assistant's answers, then this user turn."""
    messages = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
    for i in range(turn):
        messages += [{"role": "user", "content": prompt["turns"][i]}, {"role": "assistant", "content": replies[i]}]
    return messages + [{"role": "user", "content": prompt["turns"][turn]}]


def cache_capacity(tokenizer, prompts: list[dict], ecfg, config) -> int:
    """KV-cache positions a static target engine needs for these prompts: the longest
    conversation's user turns, each answer's max_new_tokens plus room for re-tokenising
    it in the next turn, and one verification's k + 1; rounded up to 64."""
    need = max(positions_needed(tokenizer, prompt, ecfg) for prompt in prompts)
    return min(-(-need // 64) * 64, getattr(config, "max_position_embeddings", None) or need)
