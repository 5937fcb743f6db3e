"""Hard truncation to a token budget: drop the head, the middle or the tail of a text.

One encoding per text (`Tokenizer.cuts`); each budget is then a binary search over the cuts.
Cuts fall between tokens and never inside a character, and prefer not to split a grapheme
(emoji sequence, flag, letter + combining mark). Callers re-count the result: BPE can differ
by a token at a cut, and `fit` lowers the budget by the excess until the count fits.
"""

from __future__ import annotations

import numpy as np

from ctxwarden.context import segment
from ctxwarden.context.tokenizers import Tokenizer

TRUNCATIONS = ("truncate-head", "truncate-middle", "truncate-tail")


class Truncator:
    """Cuts of one text, ready to answer head/middle/tail truncations for any budget."""

    def __init__(self, text: str, tokenizer: Tokenizer):
        self.text = text
        self.cuts = tokenizer.cuts(text)
        levels = segment.boundary_levels(text)[self.cuts.cut_chars]
        # Prefer cuts outside graphemes; fall back to every cut when there are none.
        usable = levels >= segment.TOKEN
        self.chars = self.cuts.cut_chars[usable] if usable.sum() >= 2 else self.cuts.cut_chars
        self.tokens = self.cuts.cut_tokens[usable] if usable.sum() >= 2 else self.cuts.cut_tokens

    def keep_head(self, budget_tokens: int) -> str:
        """The longest prefix of at most budget_tokens tokens (the tail is dropped)."""
        k = int(np.searchsorted(self.tokens, budget_tokens, side="right")) - 1
        return self.text[: int(self.chars[max(k, 0)])]

    def keep_tail(self, budget_tokens: int) -> str:
        """The longest suffix of at most budget_tokens tokens (the head is dropped)."""
        total = int(self.tokens[-1])
        k = int(np.searchsorted(self.tokens, total - budget_tokens, side="left"))
        return self.text[int(self.chars[min(k, len(self.chars) - 1)]):]

    def keep_ends(self, budget_tokens: int) -> str:
        """Head and tail, half the budget each (the middle is dropped)."""
        head_budget = budget_tokens // 2
        head = self.keep_head(head_budget)
        tail = self.keep_tail(budget_tokens - head_budget)
        if len(head) + len(tail) >= len(self.text):
            return self.text
        return head + tail

    def apply(self, strategy: str, budget_tokens: int) -> str:
        """Run one of TRUNCATIONS."""
        if strategy == "truncate-head":
            return self.keep_tail(budget_tokens)
        if strategy == "truncate-tail":
            return self.keep_head(budget_tokens)
        if strategy == "truncate-middle":
            return self.keep_ends(budget_tokens)
        raise ValueError(f"unknown truncation {strategy!r}; expected one of {', '.join(TRUNCATIONS)}")
