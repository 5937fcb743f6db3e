"""Incremental detokenizing: token ids in, stable text deltas out, stopping at stop strings.

Two layers, one call per generated token:

1. UTF-8 layer. Decoding one byte-level token alone can end inside a character (an emoji is
   often 4 one-byte tokens), and some decoders change a token's text by its left neighbour.
   So we decode a short sliding window of token ids:

       tokens:  ... p p p | r r r | n n
                    ^prefix_offset ^read_offset
       window text = decode(tokens[prefix_offset:]); text of [prefix, read) is already out.

   Characters before a trailing run of U+FFFD are final (UTF-8 is self-synchronising), so
   they go out at once; the trailing run waits for more bytes. When the window text ends
   clean, the window slides forward (prefix <- read <- end). Each step decodes a bounded
   number of tokens: O(new text), never the whole output.

2. Stop layer. Stable text that could be the start of a stop string is held back; a stop
   string, even one spanning several tokens, ends the stream exactly where it starts (or
   where it ends, with include_stop_str_in_output). Only the last (longest stop - 1)
   characters plus the new delta are searched.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ctxwarden.request import FinishReason

REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first output tokens
# A character is at most 4 UTF-8 bytes; past this many undecodable tokens the bytes are
# garbage the model produced, and the U+FFFD it decodes to is the real text.
_MAX_PENDING_TOKENS = 16


class TokenDecoder(Protocol):
    """What the detokenizer needs: `tokenizers.Tokenizer` and HF tokenizers both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of a list of token ids."""
        ...


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text deltas, one `push` per token."""

    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(0, self._read_offset)
        self._num_taken_chars = 0  # window chars after prefix_text already passed on
        self._stops = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._recent_chars = max((len(s) for s in self._stops), default=1) - 1
        self._recent = ""  # last `_recent_chars` characters of the stable text
        self._held = ""  # stable text not yet returned: it could start a stop string
        self._parts: list[str] = []
        self._is_closed = False
        self.finish_reason: FinishReason | None = None
        self.stop_string: str | None = None  # the stop string that ended the stream

    @property
    def output_text(self) -> str:
        """All text returned so far (by push and flush)."""
        return "".join(self._parts)

    @property
    def is_finished(self) -> bool:
        """True once a stop string matched or flush() was called."""
        return self._is_closed

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became final ('' if none did)."""
        if self._is_closed:
            raise RuntimeError("push() after the stream ended (stop string matched or flush).")
        return self._emit(self._apply_stops(self._stable_delta(token_id)))

    def flush(self) -> str:
        """End the stream (EOS, length, abort): release held text, incomplete bytes as U+FFFD."""
        if self._is_closed:
            return ""
        window_text = self._decode(self._prefix_offset, len(self._tokens))
        rest = window_text[len(self._prefix_text) + self._num_taken_chars:]
        self._is_closed = True
        return self._emit(self._held + rest)

    def _emit(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._tokens[start:end],
                                      skip_special_tokens=self._skip_special_tokens)

    def _stable_delta(self, token_id: int) -> str:
        """UTF-8 layer: the new characters that no later token can change."""
        self._tokens.append(token_id)
        window_text = self._decode(self._prefix_offset, len(self._tokens))
        stable_end = len(window_text.rstrip(REPLACEMENT_CHAR))
        num_pending = len(self._tokens) - self._read_offset
        if num_pending > _MAX_PENDING_TOKENS:
            stable_end = len(window_text)
        start = len(self._prefix_text) + self._num_taken_chars
        delta = window_text[start:stable_end]
        self._num_taken_chars += len(delta)
        if stable_end == len(window_text):  # clean end: slide the window forward
            self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
            self._num_taken_chars = 0
        return delta

    def _apply_stops(self, delta: str) -> str:
        """Stop layer: return the part of `delta` (and held text) that cannot start a stop."""
        if not self._stops or not delta:
            return delta
        window = self._recent + delta
        pending = self._held + delta  # a suffix of window: everything not yet returned
        pending_start = len(window) - len(pending)
        match = _first_stop(window, self._stops, search_from=len(self._recent))
        if match is not None:
            start, stop = match
            end = start + (len(stop) if self._include_stop else 0)
            self.finish_reason, self.stop_string, self._is_closed = FinishReason.STOP, stop, True
            return pending[:max(0, end - pending_start)]
        num_held = 0 if self._include_stop else _stop_prefix_len(window, self._stops)
        num_held = min(num_held, len(pending))
        self._held = pending[len(pending) - num_held:]
        keep_from = max(0, len(window) - self._recent_chars)
        self._recent = window[keep_from:] if self._recent_chars else ""
        return pending[:len(pending) - num_held]


def _first_stop(window: str, stops: Sequence[str], search_from: int) -> tuple[int, str] | None:
    """Earliest (then longest) stop string in `window` that ends at or after `search_from`."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = window.find(stop, max(0, search_from - len(stop) + 1))
        if index >= 0 and (best is None or (index, -len(stop)) < (best[0], -len(best[1]))):
            best = (index, stop)
    return best


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
