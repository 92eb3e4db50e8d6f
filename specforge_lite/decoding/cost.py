"""The cost model: what one target verify forward of a given width (drafts + 1) costs on this machine.

It starts from a measured curve (the seconds of one forward at widths 1..n after a typical context,
`measurement.metrics.measure_forward_costs`: the curve the evaluate report prints) and learns from
the verify forwards the decoding loop times and reports to it (`observe`, the engine's
`observe_verify`). The price of a width:

- timed in this run: the mean of its timed forwards;
- not timed, on the curve: the curve's seconds scaled by how the timed widths compared with the
  curve (the mean of timed / curve over the timed widths on it; 1 while none is timed): inside the
  loop a forward also pays what the curve's tight repeats do not;
- on neither: the dearest priced width below it (a forward never costs less for more tokens), else
  the cheapest priced one; with nothing timed and no curve, no price (None).

The hybrid's policy (`policy.SourcePolicy`) prices its choices with it; the report's best k and tree
pricing read the same curve through it, with plain decoding's mean forward as the one width timed
(`measurement.metrics.costs_as_decoding_paid`).
"""

from __future__ import annotations


class CostModel:
    def __init__(self, curve: dict[int, float] | None = None):
        self.timed: dict[int, list] = {}  # width -> [seconds, forwards]
        self.start_from(curve or {})

    def start_from(self, curve: dict[int, float]) -> None:
        """Price the widths not yet timed from `curve` (seconds by width, as measured)."""
        self.curve = {int(w): float(s) for w, s in curve.items() if s > 0}

    def observe(self, width: int, seconds: float) -> None:
        """One verify forward of `width` took `seconds` (the decoding loop's own timing)."""
        timed = self.timed.setdefault(width, [0.0, 0])
        timed[0] += seconds
        timed[1] += 1

    @property
    def known(self) -> bool:
        """Whether any width has a price."""
        return bool(self.timed or self.curve)

    def means(self) -> dict[int, float]:
        return {w: seconds / n for w, (seconds, n) in self.timed.items() if n}

    def curve_scale(self, means: dict[int, float] | None = None) -> float:
        """Timed over curve, averaged over the timed widths on the curve (1 while none is)."""
        means = self.means() if means is None else means
        ratios = [mean / self.curve[w] for w, mean in means.items() if w in self.curve]
        return sum(ratios) / len(ratios) if ratios else 1.0

    def seconds(self, width: int) -> float | None:
        """The price of a verify of `width` (the module's rule)."""
        means = self.means()
        scale = self.curve_scale(means)
        prices = {**{w: seconds * scale for w, seconds in self.curve.items()}, **means}
        if width in prices:
            return prices[width]
        if not prices:
            return None
        below = [seconds for w, seconds in prices.items() if w < width]
        return max(below) if below else min(prices.values())
