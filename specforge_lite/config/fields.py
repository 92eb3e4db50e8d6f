"""`checked`: a dataclass field with the rules `specforge_lite.stages.door` checks (ranges, choices).

Kept apart from `schema.py` so every options dataclass (the root schema and each drafter's
own `Options`) can declare its rules without importing the root schema.
"""

from __future__ import annotations

from dataclasses import MISSING, field
from enum import Enum
from typing import Any


class Divergence(str, Enum):
    """The training loss between the target's and the drafter's distributions (`losses.LOSSES`)."""
    forward_kl = "forward_kl"  # KL(target || draft), the default
    reverse_kl = "reverse_kl"  # KL(draft || target)
    tvd = "tvd"  # total variation distance
    jsd = "jsd"  # Jensen-Shannon (beta 0.5)


def checked(default: Any = MISSING, *, default_factory: Any = MISSING, **rules: Any) -> Any:
    """A dataclass field whose value `specforge_lite.stages.door` checks against `rules`:

    ge / gt / le / lt: bounds of a number (of every item of a list); choices: allowed values;
    pattern: a regex the whole value matches (`allowed` says it in words); length: items of a
    list; note: a hint added to the message; below_target: a field of the target's HF config
    every value must stay below (checked once the target is known); when: sibling values under
    which the rules apply. null always passes.
    """
    return field(default=default, default_factory=default_factory, metadata=rules)
