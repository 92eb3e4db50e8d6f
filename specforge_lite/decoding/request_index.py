"""The request's own tokens as a lookup index, shared by n-gram lookup and suffix decoding.

Every n-gram of `shortest..longest` tokens in the request (prompt and answer so far) maps to the
positions that came after its occurrences, in the order they occurred: all of them (suffix
decoding follows the most frequent continuation), or the first and the latest `keep - 1` (n-gram
lookup proposes the first's or the latest's, and its trees a few more). The index grows as the
committed tokens arrive (`extend`), so a look-up costs one dictionary probe per n-gram size however
long the request is.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np


class RequestIndex:
    def __init__(self, longest: int, shortest: int = 1, keep: int | None = None):
        self.sizes = range(longest, shortest - 1, -1)  # longest first: the order look-ups try them in
        self.keep = keep
        self.ids: list[int] = []
        self.continuations: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions after its occurrences

    def extend(self, context: Sequence[int]) -> None:
        """Index the tokens of `context` (the request so far, of which the indexed tokens are a
        prefix) that are not yet indexed. An n-gram ending at the last token has no continuation yet."""
        start = len(self.ids)
        self.ids.extend(int(t) for t in context[start:])
        for end in range(max(start - 1, 0), len(self.ids) - 1):
            for n in self.sizes:
                if n > end + 1:
                    continue
                after = self.continuations.setdefault(tuple(self.ids[end + 1 - n:end + 1]), [])
                after.append(end + 1)
                if self.keep is not None and len(after) > self.keep:
                    del after[1]  # keep the first occurrence and the latest ones

    @property
    def array(self) -> np.ndarray:
        return np.asarray(self.ids, dtype=np.int64)

    def continuations_of(self, ngram: Sequence[int]) -> list[int]:
        """The positions after the indexed occurrences of `ngram`, in the order they occurred."""
        return self.continuations.get(tuple(ngram), [])

    def matches(self, context: Sequence[int]) -> Iterator[tuple[int, list[int]]]:
        """(length, the positions after each earlier occurrence) of the suffixes of `context` (the
        request, indexed first) that occurred before, longest first."""
        self.extend(context)
        for n in self.sizes:
            if n <= len(self.ids):
                after = self.continuations_of(self.ids[-n:])
                if after:
                    yield n, after
