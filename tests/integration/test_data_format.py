"""`data.format` is honoured: a source that is not of the named format is refused at the door in
one line naming data.format, the source and what it is; and a held-out split that leaves no
training conversations names data.heldout_fraction."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.test_bad_inputs import SMOKE_DATA, cli, conversation, assert_user_error, write_jsonl, written

SHAREGPT = [conversation(i, f"Question {i}?") for i in range(4)]


def messages_jsonl(tmp: Path) -> Path:
    return Path(shutil.copy(SMOKE_DATA, tmp / "good.jsonl"))


def sharegpt_json(tmp: Path) -> Path:
    path = tmp / "share.json"
    path.write_text(json.dumps(SHAREGPT))
    return path


def sharegpt_jsonl(tmp: Path) -> Path:
    return write_jsonl(tmp / "share.jsonl", SHAREGPT)


def saved_dataset(tmp: Path) -> Path:
    import datasets

    datasets.Dataset.from_list(SHAREGPT).save_to_disk(str(tmp / "ds"))
    return tmp / "ds"


def plain_folder(tmp: Path) -> Path:
    (tmp / "notes").mkdir()
    (tmp / "notes" / "a.jsonl").write_text(SMOKE_DATA.read_text())
    return tmp / "notes"


def text_file(tmp: Path) -> Path:
    return Path(shutil.copy(SMOKE_DATA, tmp / "good.txt"))


FORMAT_CASES = [  # (name, make(tmp) -> data.source, data.format, message after "data.format=FMT: SOURCE ")
    ("jsonl_as_hf_disk", messages_jsonl, "hf_disk",
     "is a .jsonl file, not a folder written by datasets.save_to_disk; give data.format=auto (or messages)"),
    ("sharegpt_json_as_hf_disk", sharegpt_json, "hf_disk",
     "is a .json file, not a folder written by datasets.save_to_disk; give data.format=auto (or sharegpt)"),
    ("plain_folder_as_hf_disk", plain_folder, "hf_disk",
     "is a folder without the state.json or dataset_dict.json that datasets.save_to_disk writes; "
     "give data.source the folder it wrote"),
    ("messages_as_sharegpt", messages_jsonl, "sharegpt",
     "holds OpenAI messages records (its first has 'messages', not 'conversations'); "
     "give data.format=auto (or messages)"),
    ("sharegpt_as_messages", sharegpt_json, "messages",
     "holds ShareGPT records (its first has 'conversations', not 'messages'); give data.format=auto (or sharegpt)"),
    ("sharegpt_jsonl_as_messages", sharegpt_jsonl, "messages", "holds ShareGPT records"),
    ("dataset_as_sharegpt", saved_dataset, "sharegpt",
     "is a folder, not a .json or .jsonl file of ShareGPT records; give data.format=auto (or hf_disk)"),
    ("dataset_as_messages", saved_dataset, "messages", "is a folder, not a .json or .jsonl file of OpenAI messages"),
    ("txt_as_messages", text_file, "messages", "is a .txt file, not a .json or .jsonl file of OpenAI messages records"),
    ("builtin_smoke_as_sharegpt", lambda tmp: "builtin:smoke", "sharegpt", "holds OpenAI messages records"),
    ("builtin_smoke_as_hf_disk", lambda tmp: "builtin:smoke", "hf_disk", "is a .jsonl file, not a folder"),
    ("builtin_sharegpt_as_messages", lambda tmp: "builtin:sharegpt", "messages", "holds ShareGPT records"),
]


@pytest.mark.fresh_cli
@pytest.mark.parametrize("name,make,fmt,message", FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
def test_a_source_not_of_data_format_is_refused_at_the_door(capsys, tmp_path, name, make, fmt, message):
    source, run_dir = make(tmp_path), tmp_path / "run"
    capsys.readouterr()  # datasets' progress bar from making the source
    code, err = cli(capsys, "sample", "+recipe=smoke", f"run_dir={run_dir}", f"data.source={source}",
                    f"data.format={fmt}", "data.max_samples=4", "sample.max_new_tokens=4")
    assert_user_error(code, err, f"data.format={fmt}: {source} {message}")
    assert len(err.strip().splitlines()) == 1, err
    assert written(run_dir) == set()


def test_run_refuses_the_wrong_format_before_it_samples(capsys, tmp_path):
    source, run_dir = messages_jsonl(tmp_path), tmp_path / "run"
    code, err = cli(capsys, "run", "+recipe=smoke", f"run_dir={run_dir}", f"data.source={source}",
                    "data.format=hf_disk")
    assert_user_error(code, err, f"data.format=hf_disk: {source} is a .jsonl file")
    assert written(run_dir) == set()


@pytest.mark.parametrize("make,fmt", [(messages_jsonl, "messages"), (sharegpt_json, "sharegpt"),
                                      (sharegpt_jsonl, "sharegpt"), (saved_dataset, "hf_disk"),
                                      (lambda tmp: "builtin:smoke", "messages")],
                         ids=["messages_jsonl", "sharegpt_json", "sharegpt_jsonl", "hf_disk", "builtin_smoke"])
def test_a_source_of_data_format_passes_the_door_and_is_read(tmp_path, make, fmt):
    from specforge_lite.data.readers import read_conversations
    from specforge_lite.stages.door import config_problems
    from tests.conftest import compose

    source = str(make(tmp_path))
    assert config_problems(compose(["+recipe=smoke", f"data.source={source}", f"data.format={fmt}"])) == []
    records, stats = read_conversations(source, fmt)
    assert records and stats.num_skipped == 0
    assert read_conversations(source, "auto")[0] == records  # auto chooses the same reader


# --------------------------------------------------------------------------- the held-out split

@pytest.mark.fresh_cli
def test_a_split_that_holds_out_everything_names_data_heldout_fraction(capsys, tmp_path):
    code, err = cli(capsys, "sample", "+recipe=smoke", f"run_dir={tmp_path}", "data.max_samples=4",
                    "sample.max_new_tokens=4", "data.heldout_fraction=0.99")
    assert_user_error(code, err, "no training conversations left from builtin:smoke: data.heldout_fraction=0.99 "
                                 "held out 16 of the 16 read; give a smaller fraction")
    assert written(tmp_path) == set()


def test_records_that_are_all_bad_keep_the_plain_message(capsys, tmp_path):
    source = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}])
    code, err = cli(capsys, "sample", "+recipe=smoke", f"run_dir={tmp_path / 'run'}", f"data.source={source}")
    assert_user_error(code, err, f"no training conversations left from {source}\n")
    assert "heldout_fraction" not in err
