"""What makes an evaluate's figures trustworthy beyond its own counting: a compiled drafter that
accepts nothing where its eager module accepts falls back to eager (`compiled_drafting`), and the
machine's own rounding of plain decoding is measured beside the methods' verdicts (`plain_rounding`)."""

from __future__ import annotations

import logging

from specforge_lite.decoding import identity
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


def compiled_drafting(decoders: dict, drafters: dict, info: dict, ids: list[int], max_new_tokens: int,
                      seed: int, decoded: dict | None = None) -> None:
    """A drafter whose compiled graphs accept no draft on the first prompt while its eager module
    does is a compile gone wrong, not a weak drafter (a bf16 graph once drafted nothing the target
    kept, and the report called it lossless): it drafts eagerly from then on, and `info` (the
    report's settings.engine) says so under `drafters_graph` and `drafters_fallback`. `decoded`: the
    warm-up's own answers to that prompt by method, read instead of decoding it again."""
    graphs = info.get("drafters_graph") or {}
    for name in [n for n in graphs if n in decoders and hasattr(drafters.get(n), "eager")]:
        first = (decoded or {}).get(name) or decoders[name](ids, max_new_tokens, seed)
        if sum(first.accepted_lengths):
            continue
        drafter = drafters[name]
        compiled = dict(vars(drafter))
        drafter.eager()
        accepted = sum(decoders[name](ids, max_new_tokens, seed).accepted_lengths)
        if not accepted:  # a drafter that accepts nothing either way: its graphs are not the cause
            vars(drafter).update(compiled)
            continue
        reason = (f"its compiled drafting graphs accepted no draft on the first prompt, where its eager module "
                  f"accepted {accepted} token(s)")
        log.warning("%s: %s; drafting eagerly", name, reason)
        graphs[name] = "eager"
        info.setdefault("drafters_fallback", {})[name] = reason
