"""DSpark checkpoints in speculators' `dspark` format (`speculators_model_type: "dspark"`): DFlash's
(`dflash/export.py`: the Qwen3 layer config, the strict reload, the logit comparison) and the
heads' fields and weights.

What vLLM 0.32 reads (`transformers_utils/configs/speculators/algos.py`, `update_dspark`;
`model_executor/models/qwen3_dspark.py`): `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`, `sample_from_anchor` (its default
false; speculators' true), and DFlash's fields; weights `markov_head.markov_w1.weight`,
`markov_head.markov_w2.weight`, `confidence_head.proj.{weight,bias}`. Its model has the vanilla
Markov head only: a gated or rnn head's extra weights would fail its load, so such an export
is written for speculators and the README says vLLM cannot serve it. vLLM 0.32 runs DSpark on
its GPU model runner only (its CPU runner has no DSpark proposer).
"""

from __future__ import annotations

from specforge_lite.drafters.dflash.export import export as export_dflash_family
from specforge_lite.drafters.dspark.interop import DSPARK, load_any


def export(cfg, trained, out, target, tokenizer, k: int, k_source: str, verifier: str) -> dict:
    """`out/speculators` in the dspark format, reloaded strictly and compared with the trained drafter
    (logits and confidences)."""
    return export_dflash_family(cfg, trained, out, target, tokenizer, k, k_source, verifier, fmt=DSPARK, load=load_any)
