"""Prompt lookup: propose the tokens that followed the last occurrence of a sequence's own latest n tokens.

A copy-heavy completion (an edit of the prompt, a quote, a list repeated with one change) keeps writing spans that
are already in its context; where its last n tokens appeared before, the tokens after them there are a good guess
for what comes next, and the executor verifies the guess in the forward pass it runs anyway.

The index is incremental, so a step's lookup costs the same at any context length: each n-gram (for every n of
the window) maps to the position right after its latest occurrence, and a token settled adds one entry per n.
Keys are the n-grams' hashes (Python's tuple hash, which is not randomized for ints); a collision only makes a
wrong proposal, which verification rejects.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One sequence's n-grams of sizes ``min_n`` to ``max_n``: hash -> position of the token that followed the
    latest occurrence. It covers the sequence's first ``indexed`` tokens (each with its follower)."""

    __slots__ = ("min_n", "max_n", "positions", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.positions: dict[int, int] = {}
        # Tokens whose n-grams ending before them are in ``positions`` (each entry points at such a token).
        self.indexed = 0

    def extend(self, tokens: Sequence[int], known: int) -> None:
        """Index the n-grams followed by a token in ``tokens[:known]`` that are not indexed yet (``known``: the
        tokens settled; a later one may still be a step's placeholder)."""
        positions, min_n, max_n = self.positions, self.min_n, self.max_n
        for end in range(max(self.indexed, min_n), known):
            for n in range(min_n, min(max_n, end) + 1):
                positions[hash(tuple(tokens[end - n : end]))] = end
        self.indexed = max(self.indexed, known)

    def propose(self, tokens: Sequence[int], known: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens to follow ``tokens[:known]``: those after the latest earlier occurrence of its
        longest suffix (``max_n`` down to ``min_n`` tokens) that occurred before; none when no suffix did. A match
        close to the end continues periodically (its own proposals follow it), as a repeating span would."""
        self.extend(tokens, known)
        positions = self.positions
        for n in range(min(self.max_n, known - 1), self.min_n - 1, -1):
            start = positions.get(hash(tuple(tokens[known - n : known])))
            if start is None:
                continue
            proposal: list[int] = []
            for i in range(start, start + limit):
                proposal.append(tokens[i] if i < known else proposal[i - known])
            return proposal
        return []

    def matches(self, tokens: Sequence[int], known: int) -> bool:
        """Whether ``tokens[:known]`` ends in an n-gram seen before (``propose`` would propose)."""
        self.extend(tokens, known)
        positions = self.positions
        return any(hash(tuple(tokens[known - n : known])) in positions
                   for n in range(self.min_n, min(self.max_n, known - 1) + 1))
