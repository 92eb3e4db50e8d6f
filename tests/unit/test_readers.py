"""Conversation readers: formats, bad records, truncated files, the held-out split."""

from __future__ import annotations

import json

import pytest

from specforge_lite import SpecforgeError
from specforge_lite.data.eval_prompts import read_eval_prompts
from specforge_lite.data.readers import heldout_split, read_conversations

GOOD = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}


def sharegpt(i, turns):
    return {"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in turns]}


BAD = {
    "missing_key": {"id": "m", "conversations": [{"from": "human"}]},
    "empty_turn": sharegpt(1, [("human", "hi"), ("gpt", "   ")]),
    "non_string_turn": sharegpt(2, [("human", "hi"), ("gpt", 42)]),
    "unknown_role": sharegpt(3, [("human", "hi"), ("robot", "beep")]),
    "ends_on_user": sharegpt(4, [("human", "hi"), ("gpt", "yo"), ("human", "and?")]),
    "roles_not_alternating": sharegpt(5, [("human", "hi"), ("human", "again"), ("gpt", "yo")]),
}


def write_json(path, records):
    path.write_text(json.dumps(records))
    return path


def test_sharegpt_json_roles_and_ids(tmp_path):
    records, stats = read_conversations(str(write_json(tmp_path / "d.json", [GOOD, GOOD])))
    assert [r["id"] for r in records] == ["a", "a#1"]  # repeated ids stay distinct
    assert records[0]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert stats.recovered == 2 and stats.num_skipped == 0


def test_bad_records_are_skipped_and_counted_by_reason(tmp_path):
    path = write_json(tmp_path / "d.json", [GOOD, *BAD.values(), GOOD])
    records, stats = read_conversations(str(path))
    assert len(records) == 2
    assert dict(stats.skipped) == {reason: 1 for reason in BAD}


def test_leading_assistant_turns_are_dropped_not_the_conversation(tmp_path):
    raw = sharegpt(9, [("gpt", "...continuing"), ("human", "hi"), ("gpt", "hello")])
    records, stats = read_conversations(str(write_json(tmp_path / "d.json", [raw])))
    assert [m["role"] for m in records[0]["messages"]] == ["user", "assistant"]
    assert stats.repaired["leading_assistant_turns_dropped"] == 1


@pytest.mark.parametrize("reason", sorted(BAD))
def test_strict_mode_names_file_and_record(tmp_path, reason):
    path = write_json(tmp_path / "d.json", [GOOD, BAD[reason]])
    with pytest.raises(SpecforgeError, match=rf"d\.json: record 1 .*{reason}"):
        read_conversations(str(path), strict=True)


def test_truncated_json_is_read_up_to_the_damage(tmp_path):
    full = json.dumps([sharegpt(i, [("human", f"q{i}"), ("gpt", f"a{i}")]) for i in range(5)])
    path = tmp_path / "cut.json"
    path.write_text(full[: full.index('"a3"') + 2])  # cut inside record 3
    records, stats = read_conversations(str(path))
    assert [r["id"] for r in records] == ["c0", "c1", "c2"]
    assert stats.skipped["truncated_tail"] == 1
    assert "recovered 3, skipped 1" in stats.summary()


def test_builtin_sharegpt_recovers_the_truncated_file():
    records, stats = read_conversations("builtin:sharegpt")
    assert stats.skipped["truncated_tail"] == 1
    # 17,671 complete conversations precede the damage; every one is kept or counted
    assert stats.recovered + stats.num_skipped - 1 == 17671
    assert stats.recovered > 17000
    assert all(r["messages"][-1]["role"] == "assistant" for r in records)


def test_messages_jsonl_with_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a"}]}),
             "{not json", json.dumps({"messages": [{"role": "user", "content": "q"}]})]
    path.write_text("\n".join(lines) + "\n")
    records, stats = read_conversations(str(path))
    assert len(records) == 1 and records[0]["id"] == "m-1"
    assert dict(stats.skipped) == {"invalid_json": 1, "ends_on_user": 1}
    with pytest.raises(SpecforgeError, match=r"m\.jsonl: line 2: invalid JSON"):
        read_conversations(str(path), strict=True)


def test_hf_dataset_on_disk(tmp_path):
    import datasets

    rows = [{"id": "x", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    records, _ = read_conversations(str(tmp_path / "ds"))
    assert records == [{"id": "x", "messages": rows[0]["messages"]}]


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(SpecforgeError, match="does not exist"):
        read_conversations(str(tmp_path / "nope.json"))


def test_heldout_split_is_deterministic_and_stable():
    records = [{"id": f"r{i}", "messages": []} for i in range(2000)]
    train, heldout = heldout_split(records, 0.1, seed=3)
    assert 150 < len(heldout) < 250 and len(train) + len(heldout) == 2000
    again_train, again_heldout = heldout_split(list(reversed(records)), 0.1, seed=3)
    assert {r["id"] for r in again_heldout} == {r["id"] for r in heldout}  # order does not matter
    _, other = heldout_split(records, 0.1, seed=4)
    assert {r["id"] for r in other} != {r["id"] for r in heldout}


def test_mt_bench_builtin():
    prompts = read_eval_prompts("builtin:mt_bench")
    assert len(prompts) == 80
    assert len({p["category"] for p in prompts}) == 8
    assert all(len(p["turns"]) == 2 for p in prompts)


def test_sharegpt_tasks_are_held_out_first_turns_by_area():
    from specforge_lite.data.eval_prompts import SHAREGPT_TASKS, load_prompts
    from tests.conftest import compose

    cfg = compose([f"eval.dataset={SHAREGPT_TASKS}", "data.source=builtin:sharegpt"])
    prompts = load_prompts(cfg)
    areas = {p["category"] for p in prompts}
    assert len(prompts) == 24 and len(areas) == 6
    assert all(sum(p["category"] == a for p in prompts) == 4 for a in areas)
    # each the first user turn of its conversation, which sits on the held-out side of the default split
    records = {r["id"]: r for r in read_conversations("builtin:sharegpt")[0]}
    for prompt in prompts:
        first = next(m["content"] for m in records[prompt["id"]]["messages"] if m["role"] == "user")
        assert prompt["turns"] == [first]
    train, heldout = heldout_split([records[p["id"]] for p in prompts], 0.02, 0)
    assert not train and len(heldout) == 24
    # a run whose split trains on some of them is refused, naming the keys to set
    with pytest.raises(SpecforgeError, match=r"training side of this run's split \(data.split_seed=1"):
        load_prompts(compose([f"eval.dataset={SHAREGPT_TASKS}", "data.source=builtin:sharegpt", "data.split_seed=1"]))
    # a drafter trained on other data has seen none of them: no split to check
    other = compose([f"eval.dataset={SHAREGPT_TASKS}", "data.source=builtin:smoke", "data.split_seed=1"])
    assert [p["id"] for p in load_prompts(other)] == [p["id"] for p in prompts]


MESSAGES = {"id": "m", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def test_data_format_is_honoured_not_just_checked(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(MESSAGES) + "\n")
    with pytest.raises(SpecforgeError, match=r"data.format=hf_disk: .*d\.jsonl is a \.jsonl file, not a folder"):
        read_conversations(str(path), "hf_disk")
    with pytest.raises(SpecforgeError, match=r"data.format='csv'; choose auto, sharegpt, messages or hf_disk"):
        read_conversations(str(path), "csv")


def test_a_named_record_format_skips_the_other_one(tmp_path):
    path = write_json(tmp_path / "d.json", [GOOD, MESSAGES, GOOD])
    records, stats = read_conversations(str(path), "sharegpt")
    assert [r["id"] for r in records] == ["a", "a#1"] and dict(stats.skipped) == {"missing_key": 1}
    assert len(read_conversations(str(path), "auto")[0]) == 3
    with pytest.raises(SpecforgeError, match=r"record 1 \(id 'm'\): missing_key: record has no 'conversations' "
                                             r"\(data.format=sharegpt\)"):
        read_conversations(str(path), "sharegpt", strict=True)


def test_format_problem_reads_only_the_first_record(tmp_path):
    from specforge_lite.data.formats import format_problem

    path = tmp_path / "d.jsonl"
    path.write_text("\n" + json.dumps(MESSAGES) + "\n{not json\n")
    assert format_problem(str(path), "messages") is None
    assert "holds OpenAI messages records" in format_problem(str(path), "sharegpt")
    path.write_text("{not json\n" + json.dumps(MESSAGES) + "\n")  # first record unreadable: the reader decides
    assert format_problem(str(path), "sharegpt") is None
    assert format_problem(str(tmp_path / "missing.json"), "sharegpt") is None  # the reader names it
    assert format_problem("", "hf_disk") is None and format_problem(str(path), "auto") is None
