"""How many tokens each evaluate method drafts: `eval.num_draft_tokens`, or a method's own
`eval.method_draft_tokens` entry METHOD:K. It reads the settings only, so the report and the
prompt budget use it without the method catalogue (`drafters/methods.py` checks the entries)."""

from __future__ import annotations


def method_k(item) -> tuple[str, int | None]:
    """One `eval.method_draft_tokens` item METHOD:K as (method, k), k None where it is no integer >= 1."""
    method, sep, k = str(item).partition(":")
    return method, int(k) if sep and method and k.strip().isdigit() and int(k) >= 1 else None


def own_draft_tokens(eval_cfg) -> dict[str, int]:
    """`eval.method_draft_tokens` entries METHOD:K as {method: k} (those that parse; the rest
    are `draft_tokens_problems`)."""
    return {method: k for method, k in map(method_k, eval_cfg.get("method_draft_tokens") or []) if k is not None}


def draft_tokens(eval_cfg, method: str) -> int:
    """The k `method` drafts: its `eval.method_draft_tokens` entry, else eval.num_draft_tokens."""
    return own_draft_tokens(eval_cfg).get(method, int(eval_cfg["num_draft_tokens"]))


def widest_k(eval_cfg) -> int:
    """The largest k any method of the evaluate drafts (the verify width less one it must hold)."""
    return max([int(eval_cfg["num_draft_tokens"]), *own_draft_tokens(eval_cfg).values()])
