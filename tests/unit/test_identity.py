"""bf16 verdicts of greedy speculative answers (measurement/identity.py): the pure rule on
hand-computed cases, real bf16 flips of a tiny random Llama, and a planted verifier bug."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from specforge_lite.decoding import verify as verifier
from specforge_lite.measurement import identity
from specforge_lite.decoding.drafters import NgramDrafter, ReplayDrafter
from specforge_lite.decoding.engine import generate_plain, generate_speculative
from specforge_lite.measurement.identity import (IDENTICAL, MISMATCH, ROUNDING, Fp32Reference, StepEvidence, classify,
                                              first_difference, ulp, within_rounding)
from specforge_lite.measurement.report import identity_cell, identity_notes
from specforge_lite.measurement.recommend import recommend
from specforge_lite.targets.loading import load_target
from tests.conftest import target_cfg


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # one answer stops where the other goes on
    assert first_difference([], []) is None


def test_ulp_is_the_dtype_spacing_at_that_magnitude():
    assert ulp(1.0, torch.bfloat16) == 2 ** -7
    assert ulp(2.5, torch.bfloat16) == 2 ** -6
    assert ulp(-20.0, torch.bfloat16) == 2 ** -3  # 16 <= 20 < 32
    assert ulp(1.0, torch.float32) == 2 ** -23
    assert ulp(0.0, torch.bfloat16) > 0
    # the spacing is real: x + ulp is the next bf16 value, x + ulp / 4 rounds back to x
    x = torch.tensor(2.5, dtype=torch.bfloat16)
    assert float(x + torch.tensor(2 ** -6, dtype=torch.bfloat16)) == 2.5 + 2 ** -6
    assert float(x + torch.tensor(2 ** -8, dtype=torch.bfloat16)) == 2.5


def test_within_rounding_counts_ulps_at_the_larger_magnitude():
    assert within_rounding(2.0, 2.0 + 4 * 2 ** -6, torch.bfloat16)  # 4 ulps at 2.06
    assert not within_rounding(2.0, 2.0 + 5 * 2 ** -6, torch.bfloat16)
    assert within_rounding(2.0, 2.0 + 5 * 2 ** -6, torch.bfloat16, ulps=5)
    assert not within_rounding(2.0, 2.0 + 4 * 2 ** -6, torch.float32)  # float32 resolves it


def test_classify_hand_cases():
    assert classify([1, 2, 3], [1, 2, 3], None, torch.bfloat16)["verdict"] == IDENTICAL
    # float32 picks the speculative token: plain's bf16 step flipped
    out = classify([1, 2, 3], [1, 7, 9], StepEvidence(1.0, 1.5, reference_token=7), torch.bfloat16)
    assert (out["verdict"], out["position"], out["plain_token"], out["other_token"]) == (ROUNDING, 1, 2, 7)
    assert out["margin_ulps"] == pytest.approx(-0.5 / 2 ** -7)
    # float32 agrees with plain, the other token 2 ulps behind: within rounding
    assert classify([4], [5], StepEvidence(2.0, 2.0 - 2 * 2 ** -6, 4), torch.bfloat16)["verdict"] == ROUNDING
    # float32 agrees with plain, the other token far behind: a mismatch
    assert classify([4], [5], StepEvidence(2.0, 1.0, 4), torch.bfloat16)["verdict"] == MISMATCH
    # the same 2-ulp gap of bf16 is a mismatch of a float32 run
    assert classify([4], [5], StepEvidence(2.0, 2.0 - 2 * 2 ** -6, 4), torch.float32)["verdict"] == MISMATCH
    # 6 ulps apart, but the run's dtype erred by 4 ulps on that very margin: within its rounding
    ulp2 = 2 ** -6
    out = classify([4], [5], StepEvidence(2.0, 2.0 - 6 * ulp2, 4, dtype_margin=-2 * ulp2), torch.bfloat16)
    assert out["verdict"] == ROUNDING and out["noise_ulps"] == pytest.approx(8.0)
    # a clear margin is not excused by a small error of the dtype
    out = classify([4], [5], StepEvidence(2.0, 1.5, 4, dtype_margin=0.5 + ulp2), torch.bfloat16)
    assert out["verdict"] == MISMATCH and out["noise_ulps"] == pytest.approx(1.0)
    # one answer ended where the other went on, or no evidence: a mismatch
    assert classify([4, 5], [4], None, torch.bfloat16)["verdict"] == MISMATCH
    assert classify([4], [5], None, torch.bfloat16)["verdict"] == MISMATCH


def test_summarise_sentence():
    counts = identity.summarise([IDENTICAL] * 15 + [ROUNDING] * 9)
    assert counts["text"] == "no mismatch 24/24 (15 identical, 9 within rounding)"
    assert identity.summarise([IDENTICAL, MISMATCH])["text"] == "1 mismatch in 2 (1 identical, 0 within rounding)"


@pytest.fixture(scope="module")
def bf16_target():
    model, _ = load_target(target_cfg("builtin:tiny-llama", dtype="bfloat16"))
    return model


def _prompts(vocab: int, count: int) -> list[list[int]]:
    """Prompts with repeats, so that n-gram lookup drafts (and the drafts get verified)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        p = torch.randint(3, vocab, (12,), generator=g).tolist()
        out.append(p + p[:6] + p)
    return out


def _answers(model, prompts, max_new_tokens, stop_at_first_difference=False):
    """The evaluate stage's answer dicts for plain and ngram (greedy), then `identity.judge`."""
    answers = []
    for i, ids in enumerate(prompts):
        plain = generate_plain(model, ids, max_new_tokens)
        ngram = generate_speculative(model, NgramDrafter(), ids, max_new_tokens, 3)
        for name, gen in (("plain", plain), ("ngram", ngram)):
            answers.append(dict(prompt={"id": i, "category": "x"}, turn=0, method=name, gen=gen,
                                identical=gen.tokens == plain.tokens, ids=ids))
        if stop_at_first_difference and ngram.tokens != plain.tokens:
            break
    identity.judge(model, answers)
    return [a for a in answers if a["method"] == "ngram"]


def test_real_bf16_flips_are_rounding(bf16_target):
    """A correct verifier in bf16: the answers that part from plain's do so at near-ties, which
    the float32 recomputation calls rounding (never a mismatch)."""
    ngram = _answers(bf16_target, _prompts(bf16_target.config.vocab_size, 16), 40, stop_at_first_difference=True)
    differing = [a for a in ngram if not a["identical"]]
    assert differing, "no bf16 flip in 16 prompts of 40 tokens: the test needs one to classify"
    fp32 = copy.deepcopy(bf16_target).float()
    for a in differing:
        v = a["verdict"]
        assert v["verdict"] == ROUNDING and v["reference_dtype"] == "float32", v
        # checked apart from the classifier: a float32 copy made here, on the shared context, finds
        # the two tokens a near-tie (within 16 bf16 ulps at their magnitude) or prefers the other
        context = a["ids"] + a["gen"].tokens[:v["position"]]
        with torch.no_grad():
            logits = fp32(torch.tensor([context])).logits[0, -1]
        plain_logit, other_logit = float(logits[v["plain_token"]]), float(logits[v["other_token"]])
        bf16_ulp = 2.0 ** (math.floor(math.log2(max(abs(plain_logit), abs(other_logit)))) - 7)
        assert plain_logit - other_logit <= 16 * bf16_ulp, (plain_logit, other_logit, v)
    fields = identity.entry_fields(ngram, greedy=True)
    assert fields["identical_to_plain"] is False and fields["lossless"] is True
    assert fields["identity"]["rounding"] == len(differing) and fields["identity"]["mismatch"] == 0
    assert identity.log_suffix(fields).startswith("  no mismatch ")


def test_planted_verifier_bug_is_a_mismatch_in_bf16(bf16_target, monkeypatch):
    """A verifier that keeps one draft token more than the target agreed with: its answers part from
    plain's at a token the target did not choose, and bf16 rounding must not excuse it."""
    honest = verifier.greedy_verify

    def one_too_many(draft, logits):
        accepted, token = honest(draft, logits)
        if accepted < len(draft):  # keep the rejected draft as well, then the target's next choice
            return accepted + 1, int(logits[accepted + 1].argmax())
        return accepted, token

    monkeypatch.setattr(verifier, "greedy_verify", one_too_many)
    ngram = _answers(bf16_target, _prompts(bf16_target.config.vocab_size, 3), 24)
    verdicts = [a["verdict"]["verdict"] for a in ngram]
    assert MISMATCH in verdicts, verdicts
    fields = identity.entry_fields(ngram, greedy=True)
    assert fields["lossless"] is False
    assert identity.log_suffix(fields).startswith("  OUTPUT DIFFERS: ")
    # the report's cell and its recommendation: a mismatch fails, rounding does not
    entry = {**fields, "tokens_per_s": 10.0, "speedup": 1.1, "tau": 1.5}
    assert identity_cell(entry).startswith("NO: ")
    report = {"dtype": "bfloat16", "settings": {}, "methods": {
        "plain": {"identical_to_plain": True, "identity": identity.summarise([IDENTICAL] * 3), "lossless": True,
                  "tokens_per_s": 9.0, "speedup": 1.0, "tau": 1.0},
        "ngram": entry}}
    report["methods"]["plain"]["identity"]["rule"] = fields["identity"]["rule"]
    assert recommend(report)["deploy"] == "plain"
    assert "MISMATCH in ngram" in identity_notes(report)[0]


def test_fp32_reference_of_a_float32_model_is_the_model(bf16_target):
    model, _ = load_target(target_cfg("builtin:tiny-llama"))
    assert Fp32Reference(model)._reference() is model
    twin = Fp32Reference(bf16_target)._reference()
    assert twin is not bf16_target and twin.dtype == torch.float32 and bf16_target.dtype == torch.bfloat16


def test_evaluate_stage_reports_verdicts_and_fails_a_planted_bug_in_bf16(tmp_path, monkeypatch):
    """Wired into the evaluate stage: each method's JSON entry carries the counts, the Markdown
    column says them, and a planted verifier bug is a mismatch that the recommendation skips."""
    import json

    from specforge_lite.stages import evaluate
    from tests.unit.test_evaluate import eval_cfg, write_prompts

    dataset = write_prompts(tmp_path / "prompts.jsonl")
    cfg = eval_cfg(tmp_path, f"eval.dataset={dataset}", "eval.max_prompts=2", "eval.methods=[ngram]",
                   "target.dtype=bfloat16", "eval.max_new_tokens=16", "eval.warmup=0", "eval.engine=hf",
                   "eval.cost_repeats=1", "eval.bootstrap.resamples=100")
    evaluate.run(cfg)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    for name, entry in report["methods"].items():  # a correct verifier: never a mismatch
        counts = entry["identity"]
        assert counts["mismatch"] == 0 and entry["lossless"] is True, (name, counts)
        assert counts["answers"] == report["num_answers"] and f"{counts['answers']}/{counts['answers']}" in counts["text"]

    honest = verifier.greedy_verify

    def one_too_many(draft, logits):
        accepted, token = honest(draft, logits)
        return (accepted + 1, int(logits[accepted + 1].argmax())) if accepted < len(draft) else (accepted, token)

    monkeypatch.setattr(verifier, "greedy_verify", one_too_many)
    evaluate.run(cfg)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    ngram = report["methods"]["ngram"]
    assert ngram["identity"]["mismatch"] >= 1 and ngram["lossless"] is False
    assert ngram["identity"]["differing"] and ngram["identity"]["differing"][0]["verdict"] in ("rounding", "mismatch")
    assert report["recommendation"]["deploy"] == "plain"
    markdown = (tmp_path / "eval" / "report.md").read_text()
    assert "| NO: " in markdown and "MISMATCH in ngram" in markdown


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rounding_baseline_replays_plain_at_width_k_plus_1(bf16_target, dtype):
    """Plain decoded again is plain (decoding is deterministic on one machine); plain's own tokens
    re-verified k + 1 at a time are accepted in k-token runs, and wherever the verify width rounds
    them apart the verdict is rounding, never a mismatch."""
    model = bf16_target if dtype == "bfloat16" else load_target(target_cfg("builtin:tiny-llama"))[0]
    rows = []
    for ids in _prompts(model.config.vocab_size, 6):
        plain = generate_plain(model, ids, 24)
        replayed = generate_speculative(model, ReplayDrafter(len(ids), plain.tokens), ids, 24, 3)
        assert max(replayed.accepted_lengths) == 3  # the width-4 forwards keep plain's tokens
        if replayed.tokens == plain.tokens:
            assert replayed.num_forwards <= -(-(len(plain.tokens) - 1) // 4) + 1
        rows.append({"ids": ids, "plain": plain.tokens, "again": generate_plain(model, ids, 24).tokens,
                     "replayed": replayed.tokens})
    baseline = identity.rounding_baseline(model, rows, 4)
    assert baseline["dtype"] == dtype and baseline["width"] == 4
    assert baseline["again"]["identical"] == 6 and baseline["replayed"]["mismatch"] == 0
    assert baseline["replayed"]["identical"] + baseline["replayed"]["rounding"] == 6
    assert baseline["text"].startswith(f"Rounding baseline ({dtype}): plain decoded again: no mismatch 6/6 (6 identical")
    assert "plain's tokens re-verified at width 4: " in baseline["text"]


def test_cell_and_log_line_always_carry_the_counts():
    counts = identity.summarise([IDENTICAL] * 3)
    assert identity_cell({"identity": counts}) == "no mismatch 3/3 (3 identical, 0 within rounding)"
    assert identity.log_suffix({"identity": counts}) == "  no mismatch 3/3 (3 identical, 0 within rounding)"
    assert identity_cell({"identical_to_plain": False, "identical_answers": "1/2"}) == "NO (1/2)"  # an older report
    assert identity.log_suffix({"identical_to_plain": None}) == ""  # sampled
