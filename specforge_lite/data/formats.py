"""What each `data.format` names, and the one-line refusal of a source that is not of it.

- `auto`: chosen by the source: a folder is `hf_disk`, a `.json` file one JSON array, a
  `.jsonl` file one record a line, each record ShareGPT or OpenAI `messages`;
- `sharegpt`: a `.json` or `.jsonl` file of ShareGPT records (`conversations`: `from`, `value`);
- `messages`: a `.json` or `.jsonl` file of OpenAI records (`messages`: `role`, `content`);
- `hf_disk`: a folder written by `datasets.save_to_disk` (its rows either record format).

The door asks `format_problem` before anything runs, and `readers.read_conversations` before
it reads; it reads one record at most.
"""

from __future__ import annotations

import json
from pathlib import Path

# the record formats: the key each one's records have, and its name in messages
RECORDS = {"sharegpt": ("conversations", "ShareGPT"), "messages": ("messages", "OpenAI messages")}
FORMATS = ("auto", *RECORDS, "hf_disk")
FILE_SUFFIXES = (".json", ".jsonl")
SMOKE_FILE = Path(__file__).resolve().parent.parent / "assets" / "smoke_conversations.jsonl"
# what datasets.save_to_disk writes at the top of its folder (a Dataset, a DatasetDict)
HF_DISK_MARKERS = ("state.json", "dataset_dict.json")


def format_problem(source: str, fmt: str) -> str | None:
    """Why `source` is not of data.format `fmt`, in one line; None when it is, for auto, or when
    the source is not there or not known (read_conversations names those)."""
    path = SMOKE_FILE if source == "builtin:smoke" else Path(source).expanduser()
    known = source == "builtin:sharegpt"  # a ShareGPT .json, whether or not its package is installed
    if fmt == "auto" or fmt not in FORMATS or not source.strip() or not (known or path.exists()):
        return None
    head, name = f"data.format={fmt}: {source}", RECORDS.get(fmt, ("", ""))[1]
    if not known and path.is_dir():
        if fmt != "hf_disk":
            return (f"{head} is a folder, not a .json or .jsonl file of {name} records; "
                    "give data.format=auto (or hf_disk)")
        if not any((path / marker).is_file() for marker in HF_DISK_MARKERS):
            return (f"{head} is a folder without the state.json or dataset_dict.json that datasets.save_to_disk "
                    "writes; give data.source the folder it wrote")
        return None
    suffix = ".json" if known else path.suffix
    shape = "sharegpt" if known else first_record_format(path) if suffix in FILE_SUFFIXES else None
    a_file = f"a {suffix} file" if suffix else "a file without a suffix"
    if fmt == "hf_disk":
        return (f"{head} is {a_file}, not a folder written by datasets.save_to_disk; give data.format=auto"
                + (f" (or {shape})" if shape else ""))
    if suffix not in FILE_SUFFIXES:
        return f"{head} is {a_file}, not a .json or .jsonl file of {name} records"
    if shape and shape != fmt:
        return (f"{head} holds {RECORDS[shape][1]} records (its first has {RECORDS[shape][0]!r}, not "
                f"{RECORDS[fmt][0]!r}); give data.format=auto (or {shape})")
    return None


def first_record_format(path: Path) -> str | None:
    """sharegpt or messages: which key the first record of a .json or .jsonl file has; None when
    it has neither or is not readable (a first record longer than the first MiB included)."""
    try:
        with path.open("rb") as fh:
            data = next((line for line in fh if line.strip()), b"") if path.suffix == ".jsonl" else fh.read(1 << 20)
        text = data.decode("utf-8-sig", errors="replace").lstrip()
        if path.suffix != ".jsonl":
            text = text.removeprefix("[").lstrip()
        first, _ = json.JSONDecoder().raw_decode(text)
    except (OSError, ValueError):
        return None
    return next((fmt for fmt, (key, _) in RECORDS.items() if isinstance(first, dict) and key in first), None)
