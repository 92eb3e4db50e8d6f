"""Inputs that used to pass the door and fail after work, or never end (issue 65), each tried
through the real CLI on the smoke recipe: refused with one line and exit status 2 before any
stage writes anything (Hydra's own logs aside)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from specforge_lite.data.eval_prompts import SHAREGPT_TASKS
from tests.conftest import run_cli
from tests.forked_cli import FRESH_ENV
from tests.integration.test_bad_inputs import assert_user_error, cli, written

TWO_RANKS = ("trainer.num_processes=2",)


@pytest.mark.fresh_cli  # each also in a fresh interpreter (tests/conftest.py)
@pytest.mark.parametrize("overrides,message", [
    (["eval.dataset=/no/such/prompts.jsonl"], "eval.dataset='/no/such/prompts.jsonl': no such file"),
    (["eval.dataset=builtin:mtbench"], "eval.dataset='builtin:mtbench': no such built-in prompt set; known: heldout, "
                                       "builtin:mt_bench, builtin:sharegpt_tasks"),
    (["eval.dataset=heldout", "data.heldout_fraction=0"], "eval.dataset=heldout with data.heldout_fraction=0 holds no "
                                                          "conversation out of training"),
    # the ShareGPT task prompts were picked from the default split's held-out side: another seed trains on some
    ([f"eval.dataset={SHAREGPT_TASKS}", "data.source=builtin:sharegpt", "data.split_seed=7"],
     f"eval.dataset={SHAREGPT_TASKS}: "),
])
def test_runs_prompt_set_is_refused_before_sample_and_train(capsys, tmp_path, overrides, message):
    """`run` used to sample and train, then find the prompt set missing or overlapping the training split."""
    code, err = cli(capsys, "run", "+recipe=smoke", f"run_dir={tmp_path}", *overrides)
    assert_user_error(code, err, message)
    assert len(err.strip().splitlines()) == 1, err
    assert written(tmp_path) == set()


def test_a_prompts_file_without_a_usable_prompt_is_refused_before_sample_and_train(capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question": "no turns here"}\n{"turns": []}\n')
    run_dir = tmp_path / "run"
    code, err = cli(capsys, "run", "+recipe=smoke", f"run_dir={run_dir}", f"eval.dataset={prompts}")
    assert_user_error(code, err, f"eval.dataset='{prompts}' holds no usable prompt")
    assert written(run_dir) == set()


@pytest.mark.parametrize("overrides,message", [
    # run trains eagle3: a method of another trained kind has no drafter to read after training
    (["eval.methods=[plain,medusa_hybrid]", "eval.best_k_method=null"],
     "eval.methods needs a trained medusa drafter, and this run trains drafter=eagle3: set eval.drafter_dirs.medusa"),
    (["eval.methods=[plain,vllm_dflash]", "eval.best_k_method=null"], "eval.methods needs a trained dflash drafter"),
    # EAGLE-3's default norm_before_residual has no place in SGLang's layout: known before training
    (["export.sglang=true"], "export.sglang=true with drafter=eagle3: the SGLang layout has no norm_before_residual"),
])
def test_what_run_would_refuse_after_training_is_refused_first(capsys, tmp_path, overrides, message):
    code, err = cli(capsys, "run", "+recipe=smoke", f"run_dir={tmp_path}", *overrides)
    assert_user_error(code, err, message)
    assert written(tmp_path) == set()


def test_an_unknown_builtin_prompt_set_lists_the_known_ones_in_evaluate_too(capsys, tmp_path):
    code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={tmp_path}", "eval.dataset=builtin:nope")
    assert_user_error(code, err, "known: heldout, builtin:mt_bench, builtin:sharegpt_tasks")


@pytest.mark.fresh_cli
def test_a_busy_master_port_is_refused_before_any_rank_starts(capsys, tmp_path):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        code, err = cli(capsys, "run", "+recipe=smoke", f"run_dir={tmp_path}", *TWO_RANKS,
                        f"trainer.master_port={port}")
    assert_user_error(code, err, f"trainer.master_port={port}: another process listens on it")
    assert written(tmp_path) <= {".locks"} and not (tmp_path / "samples").exists()


@pytest.mark.fresh_cli
def test_an_unresolvable_master_addr_is_refused_not_waited_on(capsys, tmp_path):
    """It waited forever in the rendezvous (issue 65); `.invalid` never resolves (RFC 6761)."""
    start = time.monotonic()
    code, err = cli(capsys, "train", "+recipe=smoke", f"run_dir={tmp_path}", *TWO_RANKS,
                    "trainer.master_addr=node0.invalid")
    assert_user_error(code, err, "trainer.master_addr='node0.invalid': the name does not resolve")
    assert time.monotonic() - start < 60
    assert not (tmp_path / "samples").exists() and not (tmp_path / "train").exists()


def test_a_forked_and_a_fresh_run_refuse_alike(tmp_path):
    """The suite forks its commands from a warm server; a user starts a fresh interpreter. The same
    refusal from both: the same status and the same stderr, line for line."""
    args = ("run", "+recipe=smoke", f"run_dir={tmp_path}", "eval.dataset=builtin:mtbench", "train.batch_size=-1")
    forked = run_cli(*args, env={**os.environ, FRESH_ENV: "0"})
    fresh = run_cli(*args, env={**os.environ, FRESH_ENV: "1"})
    assert forked.returncode == fresh.returncode == 2
    assert forked.stderr.splitlines() == fresh.stderr.splitlines() and forked.stderr.startswith("error: "), \
        (forked.stderr, fresh.stderr)
    assert written(tmp_path) == set()


def test_the_recipes_best_k_method_yields_to_the_command_lines_methods(capsys, tmp_path):
    """The smoke recipe names eagle3 for best k: `eval.methods=[plain,ngram]` on the command line was
    refused until eval.best_k_method=null was added too (a trip in one probe in four: issue 65).
    The recipe's choice now yields to the first chain method; one given on the command line is
    still held to the methods."""
    import json

    quick = ("eval.max_prompts=1", "eval.max_new_tokens=4", "eval.warmup=0", "eval.plots=false")
    code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={tmp_path}", "eval.methods=[plain,ngram]", *quick)
    assert code in (0, None), err
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["best_k_method"] == "ngram"
    code, err = cli(capsys, "evaluate", "+recipe=smoke", f"run_dir={tmp_path / 'other'}", "eval.methods=[plain,ngram]",
                    "eval.best_k_method=eagle3", *quick)
    assert_user_error(code, err, "eval.best_k_method='eagle3' is not one of eval.methods ['plain', 'ngram']")


@pytest.mark.fresh_cli
@pytest.mark.parametrize("override,message", [
    ("trainer.master_port=abc", "error: trainer.master_port=abc: Value 'abc' of type 'str' could not be converted to "
                                "Integer"),
    ("sample.bogus=3", "error: Could not override 'sample.bogus': To append to your config use +sample.bogus=3; "
                       "Key 'bogus' not in 'SampleConfig'"),
])
def test_hydras_refusal_of_an_override_is_one_line(capsys, tmp_path, override, message):
    """Hydra said it in six lines with no `error:` (its full_key, types and HYDRA_FULL_ERROR hint)."""
    code, err = cli(capsys, "train", "+recipe=smoke", f"run_dir={tmp_path}", override)
    assert code == 2 and err.strip().splitlines() == [message], err
    assert not tmp_path.exists() or written(tmp_path) == set()
