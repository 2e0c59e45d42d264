"""Prompt lookup: drafted tokens copied from a request's own prompt and output.

The draft for a sequence ``s`` (prompt then output) is found as in prompt-lookup
decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method): for ``n``
from ``ngram_max`` down to ``ngram_min``, the last ``n`` tokens of ``s`` are looked up
among the earlier n-grams of ``s``; at the first ``n`` that occurs, the tokens that
followed its most recent earlier occurrence (at most ``k``) are the draft.

:class:`NgramIndex` keeps, per request, each n-gram's most recent end position, added
incrementally as the sequence grows (every token is indexed once per ``n``), so a
lookup is ``ngram_max - ngram_min + 1`` dictionary probes, not a scan of the prompt.
"""

from __future__ import annotations

from collections.abc import Callable


class NgramIndex:
    """The n-grams (``n`` in ``[n_min, n_max]``) of one growing token sequence.

    Args:
        n_min: shortest n-gram (tokens, >= 1).
        n_max: longest n-gram (tokens, >= n_min).

    Attributes:
        indexed: the sequence positions ``p`` whose n-grams ending at ``p - 1`` are in
            the index (``p <= indexed``).
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        # n-gram -> end (exclusive) of its most recent occurrence already indexed
        self._last: dict[tuple[int, ...], int] = {}
        self.indexed = 0

    def _add_until(self, ids: list[int], end: int) -> None:
        """Index the n-grams ending before ``end`` (exclusive) not indexed yet."""
        for p in range(self.indexed + 1, end + 1):  # n-grams ending at p - 1
            for n in range(self.n_min, min(self.n_max, p) + 1):
                self._last[tuple(ids[p - n : p])] = p
        self.indexed = max(self.indexed, end)

    def propose(self, ids: list[int], k: int) -> list[int]:
        """At most ``k`` drafted tokens continuing ``ids`` (possibly none).

        Args:
            ids: the whole sequence so far (prompt then output; it only grows between
                calls: the index remembers what it has seen).
            k: most tokens to draft (>= 0).

        Returns:
            The tokens after the most recent earlier occurrence of the longest suffix
            n-gram that occurred before; ``[]`` when no suffix did.
        """
        L = len(ids)
        self._add_until(ids, L - 1)  # every n-gram but the suffixes themselves
        out: list[int] = []
        if k > 0:
            for n in range(min(self.n_max, L), self.n_min - 1, -1):
                end = self._last.get(tuple(ids[L - n :]))
                if end is not None:
                    out = ids[end : end + k]
                    break
        return out


def usable_prefix(draft: list[int], ok: Callable[[int], bool]) -> list[int]:
    """``draft`` up to its first token that ``ok`` refuses (image pseudo-ids, ids past
    the vocabulary: no drafted position may take an embedding it cannot have)."""
    for i, t in enumerate(draft):
        if not ok(t):
            return draft[:i]
    return draft
