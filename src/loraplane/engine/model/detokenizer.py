"""Incremental detokenization with stop strings (torch-free; the tokenizer is duck-typed, never imported).

Decoding token by token is wrong for byte-level BPE: one character can span tokens (a partial UTF-8 sequence
decodes to U+FFFD) and SentencePiece drops a leading space when a slice starts mid-text. As in vLLM, each new
token is decoded inside a short window: text = decode(ids[prefix:]) minus decode(ids[prefix:read]); the window
only moves on once the text no longer ends in a replacement character.

Stop strings truncate the output where they begin. While streaming, text that could still turn into a stop
string (a suffix that is a prefix of one) is held back, so a client never sees half a stop string. Both checks
run per token on the engine thread, so they cost only the new characters (a Knuth-Morris-Pratt automaton per
stop string), never the length of the text so far or of the stop strings.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
_PREFIX_WINDOW = 5  # prompt tokens decoded as context for the first output token


class TokenizerLike(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def _failure_table(pattern: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of pattern[: i + 1] that is also its suffix."""
    fail, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Finds stop strings in text fed piece by piece, in time linear in the text.

    For every stop string it keeps how many of its first characters the text fed so far ends with (the KMP
    state), so "does one end in the new piece?" and "how long a tail could still become one?" read only the
    new characters.
    """

    __slots__ = ("stops", "_fail", "_state")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)  # an empty stop string can never be waited for
        self._fail = [_failure_table(s) for s in self.stops]
        self._state = [0] * len(self.stops)

    def feed(self, piece: str, offset: int) -> tuple[int, str] | None:
        """Advance over ``piece`` (which starts at ``offset`` of the whole text); the earliest-starting stop
        string that ends inside it as (its start in the whole text, the string), else None."""
        found: tuple[int, str] | None = None
        for i, stop in enumerate(self.stops):
            fail, state = self._fail[i], self._state[i]
            for j, char in enumerate(piece):
                while state and stop[state] != char:
                    state = fail[state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):  # this string's first match: later ones start later
                    start = offset + j + 1 - len(stop)
                    if found is None or start < found[0]:
                        found = (start, stop)
                    break
            self._state[i] = state
        return found

    def held_back(self) -> int:
        """The length of the longest tail of the text fed so far that is a proper prefix of a stop string."""
        return max(self._state, default=0)


class IncrementalDetokenizer:
    __slots__ = (
        "tokenizer",
        "_decode_ids",
        "token_ids",
        "prefix_offset",
        "read_offset",
        "text",
        "stop",
        "_matcher",
        "skip_special_tokens",
        "stopped_on",
        "_emitted",
    )

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        # An HF fast tokenizer's Rust backend decodes ~2.5x faster than its Python wrapper (and skips the
        # wrapper's clean-up of spaces, which is wrong mid-stream anyway); this runs for every token.
        self._decode_ids = getattr(tokenizer, "backend_tokenizer", tokenizer).decode
        self.token_ids = list(prompt_token_ids)
        self.read_offset = len(self.token_ids)  # ids before it are already in the text (or are the prompt)
        self.prefix_offset = max(0, self.read_offset - _PREFIX_WINDOW)
        self.text = ""  # the output so far, truncated at a stop string once one matched
        self.stop = stop
        self._matcher = StopMatcher(stop)
        self.skip_special_tokens = skip_special_tokens
        self.stopped_on: str | None = None  # the stop string that ended the output
        self._emitted = 0  # chars of self.text already handed out by take_delta()

    def watch(self, stop: tuple[str, ...]) -> None:
        """Look for ``stop`` in the text from the next token on (min_tokens: none ends the output before)."""
        self.stop, self._matcher = stop, StopMatcher(stop)

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> bool:
        """Append one generated token; True when a stop string now ends the output."""
        if self.stopped_on is not None:
            raise RuntimeError("add_token after a stop string matched")
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return False  # an incomplete character (or nothing visible yet): wait for more bytes
        previous_len = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._check_stop(previous_len)

    def _check_stop(self, previous_len: int) -> bool:
        found = self._matcher.feed(self.text[previous_len:], previous_len)
        if found is None:
            return False
        start, self.stopped_on = found
        self.text = self.text[:start]
        return True

    def flush(self) -> None:
        """At the end of the output: keep whatever bytes are pending, even if they never completed a character."""
        if self.stopped_on is None and self.read_offset < len(self.token_ids):
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset = len(self.token_ids)

    def take_delta(self, finished: bool) -> str:
        """Text not handed out before; while unfinished, minus a tail that may still become a stop string."""
        if finished:
            self.flush()
        end = len(self.text) if finished else len(self.text) - self._matcher.held_back()
        if end <= self._emitted:
            return ""
        delta, self._emitted = self.text[self._emitted : end], end
        return delta
