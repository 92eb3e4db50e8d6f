"""What makes an evaluate's figures trustworthy beyond its own counting: a compiled drafter that
proposes otherwise than its eager module falls back to eager (`compiled_drafting`), and the
machine's own rounding of plain decoding is measured beside the methods' verdicts (`plain_rounding`)."""

from __future__ import annotations

import logging

from specforge_lite.measurement import identity
from specforge_lite.decoding.drafters import ReplayDrafter
from specforge_lite.decoding.engine import generate_speculative
from specforge_lite.decoding.verify import SamplingParams

log = logging.getLogger(__name__)


def plain_rounding(model, target, plain, answers: list[dict], k: int, max_new_tokens: int, eos_ids: list[int],
                   plain_name: str = "plain", reference: identity.Fp32Reference | None = None,
                   measure: bool = True) -> dict:
    """The rounding baseline of this machine and dtype (`identity.rounding_baseline`): every plain
    answer decoded a second time, and its tokens re-verified k + 1 at a time, as a speculative
    method's verify forwards see them (`ReplayDrafter`). Not `measure` (eval.rounding_baseline=false):
    said, not measured."""
    if not measure:
        return {"dtype": str(model.dtype).removeprefix("torch."), "measured": False,
                "text": "Rounding baseline: not measured (eval.rounding_baseline=false)."}
    runner, rows = target.runner(), []
    for a in (a for a in answers if a["method"] == plain_name):
        ids, tokens = a["ids"], a["gen"].tokens
        again = plain(ids, max_new_tokens, 0).tokens
        replayed = generate_speculative(model, ReplayDrafter(len(ids), tokens), ids, max_new_tokens, k,
                                        SamplingParams(0.0, 1.0), eos_ids, None, runner).tokens
        rows.append({"ids": ids, "plain": tokens, "again": again, "replayed": replayed})
    baseline = identity.rounding_baseline(model, rows, k + 1, reference=reference)
    log.info("%s", baseline["text"])
    return baseline


def _proposals(drafter, decode) -> dict[tuple, tuple]:
    """The chain proposals `drafter` makes while `decode()` runs, by the context each was drafted
    from (`propose` wrapped on the instance for the call, then unwrapped)."""
    seen, propose = {}, drafter.propose

    def recording(ctx, k):
        proposal = propose(ctx, k)
        seen[tuple(ctx.token_ids)] = tuple(proposal.tokens)
        return proposal

    drafter.propose = recording
    try:
        decode()
    finally:
        del drafter.propose
    return seen


# the share of steps a compiled drafter must propose as its eager module does: the two round
# differently, so a near-tie may flip now and then, while a broken graph disagrees nearly always
AGREEMENT = 0.75


def compiled_drafting(decoders: dict, drafters: dict, info: dict, ids: list[int], max_new_tokens: int,
                      seed: int) -> None:
    """Each compiled drafter's proposals on the first prompt against its eager module's, step by step
    on the contexts both saw. A graph that proposes otherwise on more than a quarter of them is a
    defect, not a weak drafter (a float32 graph fed bf16 features once drafted nothing the target
    kept, and the report called it lossless): the drafter drafts eagerly from then on, and `info`
    (the report's settings.engine) says so under `drafters_fallback`, which the report shows as a
    defect; `drafters_agreement` holds every drafter's count."""
    graphs = info.get("drafters_graph") or {}
    for name in [n for n in graphs if n in decoders and hasattr(drafters.get(n), "eager")]:
        drafter = drafters[name]
        compiled_state = dict(vars(drafter))
        compiled = _proposals(drafter, lambda: decoders[name](ids, max_new_tokens, seed))
        drafter.eager()
        eager = _proposals(drafter, lambda: decoders[name](ids, max_new_tokens, seed))
        same = [compiled[context] == eager[context] for context in compiled.keys() & eager.keys()]
        info.setdefault("drafters_agreement", {})[name] = [sum(same), len(same)]
        if same and sum(same) >= AGREEMENT * len(same):
            vars(drafter).update(compiled_state)
            continue
        for hybrid in drafters.values():  # a hybrid sharing this drafter: what it learned of the graphs is void
            if getattr(hybrid, "drafter", None) is drafter and hasattr(hybrid, "reset_estimates"):
                hybrid.reset_estimates()
        reason = (f"DEFECT: its compiled drafting graphs proposed what its eager module proposes on {sum(same)} of "
                  f"{len(same)} drafting steps of the first prompt")
        log.error("%s: %s; drafting eagerly", name, reason)
        graphs[name] = "eager"
        info.setdefault("drafters_fallback", {})[name] = reason
