"""N-gram candidates from the request's own text (paper section 3.3, first source).

This is the first, single-chain source: from the anchor, continue the most recent earlier
occurrence of the longest suffix of the committed text that occurred before, reading on along the
earlier passage. The full fill of section 3.3 (chains from every drafter pick, follower counts,
sibling continuations, buckets, source precision) extends this index.
"""

from __future__ import annotations


class SuffixIndex:
    """Index of one request's tokens (prompt, history and reply so far), extended every round.

    For every k-gram (1 <= k <= max_match) that has a token after it, the index keeps the end
    position of its most recent occurrence. A k-gram ending at the last token has no follower yet,
    so it is inserted only when the next token arrives: a lookup of the current suffix therefore
    finds only earlier occurrences, each with a known continuation.
    """

    def __init__(self, max_match: int = 16):
        if max_match < 1:
            raise ValueError("max_match must be at least 1")
        self.max_match = max_match
        self.tokens: list[int] = []
        self._end_of: dict[tuple[int, ...], int] = {}  # k-gram -> end index of latest occurrence

    def extend(self, new_tokens: list[int]) -> None:
        toks = self.tokens
        for t in new_tokens:
            end = len(toks) - 1  # the k-grams ending here now get a follower
            toks.append(t)
            if end < 0:
                continue
            for k in range(1, min(self.max_match, end + 1) + 1):
                self._end_of[tuple(toks[end - k + 1 : end + 1])] = end

    def match(self) -> tuple[int, int]:
        """(end index of the earlier occurrence, match length) of the longest matching suffix,
        or (-1, 0) when even the last token never occurred before with a follower."""
        toks = self.tokens
        for k in range(min(self.max_match, len(toks)), 0, -1):
            end = self._end_of.get(tuple(toks[-k:]))
            if end is not None:
                return end, k
        return -1, 0

    def chain(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens continuing the best earlier occurrence, and its match length."""
        end, k = self.match()
        if k == 0 or limit <= 0:
            return [], 0
        return self.tokens[end + 1 : end + 1 + limit], k
