"""Incremental detokenization over a real byte-level BPE (trained offline): multi-byte characters, stop strings."""

from __future__ import annotations

import pytest

from loraplane.engine.model.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

TEXT = "漢字 🙃 ok, héllo 世界 🙂 naïve"


def stream(tokenizer, prompt_ids, output_ids, stop=()):
    """Feed output_ids one by one; returns (deltas, stopped_at_index or None, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=stop)
    deltas = []
    for i, token_id in enumerate(output_ids):
        stopped = detok.add_token(token_id)
        last = stopped or i == len(output_ids) - 1
        deltas.append(detok.take_delta(finished=last))
        if stopped:
            return deltas, i, detok
    return deltas, None, detok


def test_streams_multibyte_characters_without_replacement_chars(byte_bpe_tokenizer):
    tok = byte_bpe_tokenizer
    prompt = tok.encode("The capital")
    output = tok.encode(TEXT)
    # Precondition: some tokens are partial UTF-8 (they decode to U+FFFD on their own).
    assert any(REPLACEMENT_CHAR in tok.decode([t]) for t in output)
    deltas, stopped, _ = stream(tok, prompt, output)
    assert stopped is None
    assert "".join(deltas) == TEXT == tok.decode(output)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert sum(1 for d in deltas if d) > 5  # it really streamed


def test_plain_tokenizers_object_works_too(byte_bpe_tokenizer):
    raw = byte_bpe_tokenizer.backend_tokenizer  # a tokenizers.Tokenizer: same duck type, no HF wrapper
    output = raw.encode(TEXT).ids
    deltas, _, _ = stream(raw, [], output)
    assert "".join(deltas) == TEXT


def test_first_token_keeps_its_leading_space(byte_bpe_tokenizer):
    tok = byte_bpe_tokenizer
    prompt, output = tok.encode("héllo"), tok.encode(" 世界 again")
    deltas, _, _ = stream(tok, prompt, output)
    assert "".join(deltas) == " 世界 again"


def test_stop_string_truncates_and_is_never_streamed_in_part(byte_bpe_tokenizer):
    tok = byte_bpe_tokenizer
    full = "Stop here. Then continue with more words"
    output = tok.encode(full)
    deltas, stopped, detok = stream(tok, [], output, stop=("Then cont",))
    assert stopped is not None and stopped < len(output) - 1
    assert detok.stopped_on == "Then cont"
    assert "".join(deltas) == "Stop here. "
    emitted = ""
    for delta in deltas:  # text handed out is never taken back
        emitted += delta
        assert "Stop here. ".startswith(emitted)


def test_earliest_of_several_stop_strings_wins(byte_bpe_tokenizer):
    tok = byte_bpe_tokenizer
    deltas, stopped, detok = stream(
        tok, [], tok.encode("hello world, hello tokens"), stop=("tokens", "world")
    )
    assert stopped is not None
    assert detok.stopped_on == "world"
    assert "".join(deltas) == "hello "


def test_held_back_prefix_is_released_when_it_does_not_complete(byte_bpe_tokenizer):
    tok = byte_bpe_tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=("Paris!",))
    for token_id in tok.encode("The capital of France is Paris"):
        assert not detok.add_token(token_id)
    held = detok.take_delta(finished=False)
    assert held == "The capital of France is "  # "Paris" may still become "Paris!"
    for token_id in tok.encode("."):
        assert not detok.add_token(token_id)
    assert detok.take_delta(finished=False) == "Paris."
    assert detok.take_delta(finished=True) == ""


def test_finish_mid_character_flushes_pending_bytes(byte_bpe_tokenizer):
    tok = byte_bpe_tokenizer
    output = tok.encode("ok 漢")
    partial = output[:-1]  # the last byte of 漢 never arrives
    deltas, _, _ = stream(tok, [], partial)
    text = "".join(deltas)
    assert text.startswith("ok ") and text.endswith(REPLACEMENT_CHAR)


def test_special_tokens_are_skipped(byte_bpe_tokenizer):
    tok = byte_bpe_tokenizer
    output = tok.encode("hello") + [tok.eos_token_id]
    deltas, _, _ = stream(tok, [], output)
    assert "".join(deltas) == "hello"


def test_add_after_stop_is_an_error(byte_bpe_tokenizer):
    tok = byte_bpe_tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=("lo",))
    ids = tok.encode("hello world")
    for token_id in ids:
        if detok.add_token(token_id):
            break
    assert detok.stopped_on == "lo" and detok.text == "hel"
    with pytest.raises(RuntimeError):
        detok.add_token(ids[0])


class CharTokenizer:
    """One token per character (id = code point): the text grows by exactly one character per token."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, token_ids))


def _reference(text: str, stops: tuple[str, ...]) -> tuple[str, str | None, int]:
    """Truncated text, the stop string that matched, held-back length: by brute force."""
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        start, stop = min(hits)
        return text[:start], stop, 0
    held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text, None, held


def test_stop_matching_agrees_with_brute_force_on_random_text():
    import random

    rng = random.Random(0)
    for _ in range(300):
        stops = tuple("".join(rng.choices("ab", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 4)))
        text = "".join(rng.choices("abc", k=rng.randint(0, 30)))
        detok = IncrementalDetokenizer(CharTokenizer(), [], stop=stops)
        emitted = ""
        for i, char in enumerate(text):
            expected, stopped_on, held = _reference(text[: i + 1], stops)
            assert detok.add_token(ord(char)) == (stopped_on is not None), (stops, text[: i + 1])
            if stopped_on is not None:  # the output ends where the first stop string to complete begins
                assert (detok.text, detok.stopped_on) == (expected, stopped_on), (stops, text[: i + 1])
                break
            emitted += detok.take_delta(finished=False)
            assert emitted == expected[: len(expected) - held], (stops, text[: i + 1])


def test_stop_checks_cost_only_the_new_text():
    """Long stop strings against a long text: each token reads only its own characters.

    Trying every prefix of every stop string against the text's tail costs the text's length squared per
    token (about half a minute here); the automaton takes milliseconds.
    """
    import time

    n = 6000
    stops = tuple(char * n for char in "wxyz")
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=stops)
    started = time.perf_counter()
    for _ in range(n):
        assert not detok.add_token(ord("a"))
        assert detok.take_delta(finished=False) == "a"
    for _ in range(n - 1):  # a tail that may still become a stop string is held back, however long
        assert not detok.add_token(ord("w"))
        assert detok.take_delta(finished=False) == ""
    assert detok.add_token(ord("w")) and detok.text == "a" * n
    assert time.perf_counter() - started < 5.0
