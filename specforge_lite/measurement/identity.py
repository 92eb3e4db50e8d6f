"""Whether a greedy speculative answer is plain decoding's, and when it is not, why not.

Greedy speculative decoding is lossless in exact arithmetic. In bf16 (the default on CUDA) a
verify forward over k + 1 tokens rounds differently from k + 1 one-token forwards, so where two
tokens' logits are nearly tied the argmax can flip and the answers part from there on. A flip
of that kind is not a verifier bug; a verifier that keeps a token the target did not choose is.
Each answer gets one of three verdicts:

- `identical`: the same tokens as plain decoding's answer to the same prompt;
- `rounding`: at the first differing position p (the context up to p is shared), a float32
  recomputation of the target's logits after that context either picks the speculative token,
  or puts the plain token's and the speculative token's logits (their margin m) within the
  run's dtype's rounding: |m| <= `ROUNDING_ULPS` units in the last place (ulps) of the dtype at
  the larger of the two logits' magnitudes (`within_rounding`), or |m| <= `NOISE_FACTOR` times
  the rounding error the dtype made on that very margin (the same context forwarded in the run's
  dtype: |m_dtype - m|). Two computations of one bf16 logit that differ only in summation order
  land a few ulps apart (the output itself is rounded to half an ulp, the hidden states feeding
  it were rounded at every layer, more of them in a deeper target), so a tie that close is one
  the run's dtype cannot resolve; plain's and the speculative forward each err by about the
  measured error, hence twice it. The rule is stated here and in every report;
- `mismatch`: anything else (the speculative token loses clearly in float32, or one answer
  stops where the other goes on): the report fails as for any non-identical answer in float32.

`first_difference`, `ulp`, `within_rounding` and `classify` are pure; `Fp32Reference` runs the
float32 recomputation (a float32 copy of the target, made once, on the first difference).
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch

IDENTICAL, ROUNDING, MISMATCH = "identical", "rounding", "mismatch"
VERDICTS = (IDENTICAL, ROUNDING, MISMATCH)
ROUNDING_ULPS = 4
NOISE_FACTOR = 2.0


def tokens_digest(tokens: Sequence[int]) -> str:
    """An answer's token ids as 16 hex digits of their SHA-256: what the report keeps per answer,
    so that two evaluates (or a recorded one and a new one) compare their answers token for token."""
    return hashlib.sha256(",".join(str(int(t)) for t in tokens).encode()).hexdigest()[:16]


def first_difference(plain: Sequence[int], other: Sequence[int]) -> int | None:
    """The first position where the two token lists differ (a length difference counts at the
    shorter one's end), None when they are equal."""
    for i, (a, b) in enumerate(zip(plain, other)):
        if a != b:
            return i
    return None if len(plain) == len(other) else min(len(plain), len(other))


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s floats at |value| (its unit in the last place): eps * 2^floor(log2
    |value|), e.g. bf16 (eps 2^-7) at 2.5 gives 2^-6; below the smallest normal, the subnormal
    spacing."""
    info = torch.finfo(dtype)
    magnitude = abs(float(value))
    if magnitude < info.tiny:
        return info.eps * info.tiny
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


def within_rounding(plain_logit: float, other_logit: float, dtype: torch.dtype, ulps: float = ROUNDING_ULPS) -> bool:
    """Whether two logits are within `ulps` ulps of `dtype` at the larger magnitude of the two."""
    magnitude = max(abs(plain_logit), abs(other_logit))
    return abs(plain_logit - other_logit) <= ulps * ulp(magnitude, dtype)


@dataclass(frozen=True)
class StepEvidence:
    """The float32 recomputation at the first differing position: the logits of plain's token and
    of the other answer's token, the float32 argmax, and the same margin (plain's logit minus the
    other's) computed in the run's dtype (None: not computed)."""

    plain_logit: float
    other_logit: float
    reference_token: int
    dtype_margin: float | None = None


def classify(plain: Sequence[int], other: Sequence[int], evidence: StepEvidence | None,
             dtype: torch.dtype, ulps: float = ROUNDING_ULPS) -> dict:
    """The verdict for one answer: {"verdict", "position", "plain_token", "other_token",
    "reference_token", "margin", "margin_ulps", "noise_ulps"} (all but the verdict None when
    identical; noise: the dtype's error on the margin, in ulps).
    `evidence` is needed where both answers have a token at the first difference; without it
    (one answer ended there) the verdict is a mismatch."""
    position = first_difference(plain, other)
    out = {"verdict": IDENTICAL, "position": position, "plain_token": None, "other_token": None,
           "reference_token": None, "margin": None, "margin_ulps": None, "noise_ulps": None}
    if position is None:
        return out
    out["verdict"] = MISMATCH
    if position >= min(len(plain), len(other)):
        return out
    out["plain_token"], out["other_token"] = int(plain[position]), int(other[position])
    if evidence is None:
        return out
    margin = evidence.plain_logit - evidence.other_logit
    spacing = ulp(max(abs(evidence.plain_logit), abs(evidence.other_logit)), dtype)
    noise = None if evidence.dtype_margin is None else abs(evidence.dtype_margin - margin)
    out.update(reference_token=int(evidence.reference_token), margin=margin, margin_ulps=margin / spacing,
               noise_ulps=None if noise is None else noise / spacing)
    if (evidence.reference_token == other[position]
            or within_rounding(evidence.plain_logit, evidence.other_logit, dtype, ulps)
            or (noise is not None and abs(margin) <= NOISE_FACTOR * noise)):
        out["verdict"] = ROUNDING
    return out


def summarise(verdicts: Sequence[str]) -> dict:
    """Counts of the three verdicts and the sentence the reports print (`verdict_text`)."""
    counts = {v: sum(1 for x in verdicts if x == v) for v in VERDICTS}
    counts["answers"] = len(verdicts)
    counts["text"] = verdict_text(counts[IDENTICAL], counts[ROUNDING], counts[MISMATCH])
    return counts


def verdict_text(identical: int, rounding: int, mismatch: int) -> str:
    """"no mismatch 24/24 (15 identical, 9 within rounding)", or "1 mismatch in 24 (...)": the
    answers within rounding are not called identical (docs/ENGINES.md "Checks that keep a
    report honest" states the three rounding criteria)."""
    total = identical + rounding + mismatch
    head = f"no mismatch {total}/{total}" if not mismatch else f"{mismatch} mismatch in {total}"
    return f"{head} ({identical} identical, {rounding} within rounding)"


class Fp32Reference:
    """Float32 logits of the target after a context: one full forward of a float32 copy of the
    model (made on first use; the model itself when it is float32 already), and the same forward
    of the model in its own dtype for the margin's rounding error."""

    def __init__(self, model):
        self.model = model
        self._twin = None

    def _reference(self):
        if self._twin is None:
            try:
                self._twin = self.model if self.model.dtype == torch.float32 else copy.deepcopy(self.model).float()
            except torch.cuda.OutOfMemoryError:  # no room for a float32 copy: the run's dtype (`dtype` says so)
                torch.cuda.empty_cache()
                self._twin = self.model
        return self._twin

    @property
    def dtype(self) -> str:
        """The dtype the reference logits were computed in (float32 unless the copy did not fit)."""
        return str(self._reference().dtype).removeprefix("torch.")

    @torch.inference_mode()
    def evidence(self, context: Sequence[int], plain_token: int, other_token: int) -> StepEvidence:
        twin = self._reference()
        ids = torch.tensor([list(context)], device=twin.device)
        logits = twin(input_ids=ids, use_cache=False).logits[0, -1].float()
        own = self.model(input_ids=ids.to(self.model.device), use_cache=False).logits[0, -1].float()
        return StepEvidence(float(logits[plain_token]), float(logits[other_token]), int(logits.argmax()),
                            float(own[plain_token] - own[other_token]))

    def release(self) -> None:
        self._twin = None


def verdict(reference: Fp32Reference, prompt_ids: Sequence[int], plain: Sequence[int], other: Sequence[int],
            dtype: torch.dtype, ulps: float = ROUNDING_ULPS) -> dict:
    """`classify` with the float32 evidence computed where the answers part (prompt + the shared
    tokens as context)."""
    position = first_difference(plain, other)
    evidence = None
    if position is not None and position < min(len(plain), len(other)):
        evidence = reference.evidence(list(prompt_ids) + list(plain[:position]), plain[position], other[position])
    return classify(plain, other, evidence, dtype, ulps)


def judge(model, answers: list[dict], plain: str = "plain", ulps: float = ROUNDING_ULPS,
          reference: Fp32Reference | None = None) -> None:
    """Sets `answer["verdict"]` (a `classify` dict) on every greedy answer of the evaluate stage:
    answers are dicts with "prompt", "turn", "method", "gen" (a Generation), "identical" (None
    when sampled: left without a verdict) and "ids" (the prompt's token ids); plain's answer to
    the same prompt and turn is the reference. The float32 copy lives only while this runs, unless
    the caller passes its `reference` (and releases it once its other verdicts are made)."""
    own = reference is None
    reference = reference or Fp32Reference(model)
    plain_tokens = {(a["prompt"]["id"], a["turn"]): a["gen"].tokens for a in answers if a["method"] == plain}
    for a in answers:
        if a["identical"] is None:
            continue
        theirs = plain_tokens[(a["prompt"]["id"], a["turn"])]
        a["verdict"] = (classify(theirs, a["gen"].tokens, None, model.dtype, ulps) if a["identical"]
                        else {**verdict(reference, a["ids"], theirs, a["gen"].tokens, model.dtype, ulps),
                              "reference_dtype": reference.dtype})
    if own:
        reference.release()


def rounding_baseline(model, answers: list[dict], width: int, ulps: float = ROUNDING_ULPS,
                      reference: Fp32Reference | None = None) -> dict:
    """How much the machine's own rounding moves plain decoding, for the report to set the methods'
    verdicts against: `answers` are {"ids", "plain", "again", "replayed"} per greedy prompt and turn
    (plain's answer, plain decoded a second time, and plain's tokens re-verified at `width` by
    `ReplayDrafter`). Returns the counts of each against plain (`summarise`'s, with each differing
    answer's verdict by the same rule as the methods') and a sentence."""
    own = reference is None
    reference = reference or Fp32Reference(model)
    out = {"dtype": str(model.dtype).removeprefix("torch."), "width": width, "measured": True}
    for key, label in (("again", "plain decoded again"), ("replayed", f"plain's tokens re-verified at width {width}")):
        verdicts = [verdict(reference, a["ids"], a["plain"], a[key], model.dtype, ulps)["verdict"] for a in answers]
        out[key] = {**summarise(verdicts), "label": label}
    if own:
        reference.release()
    out["text"] = (f"Rounding baseline ({out['dtype']}): {out['again']['label']}: {out['again']['text']}; "
                   f"{out['replayed']['label']}: {out['replayed']['text']}.")
    return out


def entry_fields(answers: list[dict], greedy: bool) -> dict:
    """One method's identity fields of the evaluate report from its answers (as `judge` left
    them): `identical_to_plain` (every answer token for token), `identical_answers` ("n/N"),
    `identity` (the verdict counts, their sentence, the rule, and each differing answer's first
    difference) and `lossless` (no mismatch: a rounding flip does not fail the report). All None
    when sampled."""
    if not greedy:
        return {"identical_to_plain": None, "identical_answers": None, "identity": None, "lossless": None}
    same = [a["identical"] for a in answers]
    verdicts = [a.get("verdict", {}).get("verdict", IDENTICAL if a["identical"] else MISMATCH) for a in answers]
    counts = summarise(verdicts)
    counts["rule"] = (f"rounding: at the first differing token, float32 picks the speculative token or puts it "
                      f"within {ROUNDING_ULPS} ulps of plain's token at that logit magnitude, or within "
                      f"{NOISE_FACTOR:g}x the error the run's dtype made on that margin")
    counts["differing"] = [{"prompt_id": a["prompt"]["id"], "turn": a["turn"] + 1, **a["verdict"]}
                           for a in answers if not a["identical"] and "verdict" in a]
    return {"identical_to_plain": all(same), "identical_answers": f"{sum(same)}/{len(same)}", "identity": counts,
            "lossless": counts[MISMATCH] == 0}


def log_suffix(entry: dict) -> str:
    """What the evaluate log line adds after a method's speed: the verdict counts (greedy), "OUTPUT
    DIFFERS" first when one is a mismatch."""
    identity = entry.get("identity")
    if identity is None:
        return "" if entry.get("identical_to_plain") in (None, True) else "  OUTPUT DIFFERS"
    return ("  OUTPUT DIFFERS: " if identity[MISMATCH] else "  ") + identity["text"]
