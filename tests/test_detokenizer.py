"""Incremental detokenization and stop strings: what a streaming reader sees, piece by piece."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers

from scheduler_svc.core.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStringMatcher, TextStream
from scheduler_svc.core.tokenizer import ModelTokenizer
from tests.service_fixtures import byte_level_tokenizer

# Characters outside the training corpus fall back to byte tokens: é is split, 日本 and 🦀 are 3 and 4 bytes.
TEXTS = ["héllo wörld", "日本語 🦀 crab", "你好🎉 and 🦀🦀", "plain ascii only", "é", "🦀"]


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(byte_level_tokenizer().to_str())


def stream_text(tokenizer: ModelTokenizer, prompt: list[int], completion: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.push(t) for t in completion]
    return [*pieces, detokenizer.flush()]


def test_the_fixture_tokenizer_splits_characters_across_tokens(tokenizer: ModelTokenizer):
    ids = tokenizer.encode("🦀")
    assert len(ids) >= 2
    assert all(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_join_to_the_text_and_never_show_a_partial_character(tokenizer: ModelTokenizer, text: str):
    prompt = tokenizer.encode("Hello world")
    pieces = stream_text(tokenizer, prompt, tokenizer.encode(text))
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_a_character_is_emitted_with_its_last_byte(tokenizer: ModelTokenizer):
    ids = tokenizer.encode("a🦀b")
    num_crab_tokens = len(ids) - 2
    pieces = stream_text(tokenizer, [], ids)
    assert pieces == ["a", *[""] * (num_crab_tokens - 1), "🦀", "b", ""]


def test_an_unfinished_character_at_the_end_is_flushed_as_replacement(tokenizer: ModelTokenizer):
    ids = tokenizer.encode("x🦀")[:-1]
    pieces = stream_text(tokenizer, [], ids)
    assert pieces[:-1] == ["x", *[""] * (len(ids) - 1)]
    assert REPLACEMENT_CHAR in pieces[-1]
    assert pieces[-1] == tokenizer.decode(ids)[1:]


def test_special_tokens_show_no_text_and_do_not_grow_the_window(tokenizer: ModelTokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
    eos = tokenizer.tokenizer.token_to_id("<|endoftext|>")
    assert [detokenizer.push(eos) for _ in range(100)] == [""] * 100
    assert len(detokenizer.window) <= 2
    assert "".join(detokenizer.push(t) for t in tokenizer.encode(" héllo")) + detokenizer.flush() == " héllo"


@given(st.text(alphabet="ab é日🦀你好🎉!", max_size=30))
@settings(max_examples=60, deadline=None)
def test_any_text_streams_back_exactly(text: str):
    tokenizer = ModelTokenizer(TOKENIZER_JSON)
    assert "".join(stream_text(tokenizer, tokenizer.encode("Hi"), tokenizer.encode(text))) == text


@given(st.text(alphabet="ab é日🦀你好🎉!", max_size=30), st.lists(st.integers(1, 9), min_size=1, max_size=12))
@settings(max_examples=80, deadline=None)
def test_tokens_pushed_together_show_the_text_they_show_one_at_a_time(text: str, sizes: list[int]):
    # A multi-step window's tokens decode at once: each batch shows what its tokens show pushed one by one.
    tokenizer = ModelTokenizer(TOKENIZER_JSON)
    prompt, ids = tokenizer.encode("Hi"), tokenizer.encode(text)
    together, one_by_one = IncrementalDetokenizer(tokenizer, prompt), IncrementalDetokenizer(tokenizer, prompt)
    pieces, start = [], 0
    for size in sizes * (len(ids) // sum(sizes) + 1):
        batch = ids[start : start + size]
        start += size
        pieces.append(together.push_many(batch))
        assert pieces[-1] == "".join(one_by_one.push(t) for t in batch)
    pieces.append(together.flush())
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_a_batch_of_tokens_costs_two_decodes_and_special_ones_do_not_grow_the_window(tokenizer: ModelTokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
    decode, calls = detokenizer.decode, []
    detokenizer.decode = lambda ids: calls.append(ids) or decode(ids)
    assert detokenizer.push_many(tokenizer.encode(" plain words for a window")) == " plain words for a window"
    assert len(calls) == 2
    eos, window = tokenizer.tokenizer.token_to_id("<|endoftext|>"), list(detokenizer.window)
    assert [detokenizer.push_many([eos] * 8) for _ in range(50)] == [""] * 50
    assert detokenizer.window == window
    assert detokenizer.push_many(tokenizer.encode(" héllo 🦀")) + detokenizer.flush() == " héllo 🦀"


def test_stop_string_spanning_pushes_is_caught_and_not_emitted():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("Hel") == ("Hel", False)
    assert matcher.push("lo ST") == ("lo ", False)
    assert matcher.held == "ST"
    assert matcher.push("OP and more") == ("", True)


def test_held_text_is_released_once_it_cannot_be_a_stop_string():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("ST") == ("", False)
    assert matcher.push("ART") == ("START", False)
    assert matcher.push("S") == ("", False)
    assert matcher.flush() == "S"


def test_the_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.push("hello world") == ("hel", True)


def test_within_min_tokens_nothing_is_matched_but_a_stop_string_ending_after_it_is():
    matcher = StopStringMatcher(["STOP", "a"])
    assert matcher.push("a STO", match=False) == ("a ", False), "a stop string within min_tokens passes"
    assert matcher.push("P!") == ("", True), "it began within min_tokens and ends after: vLLM's rule"
    assert matcher.matched == "STOP"
    matcher = StopStringMatcher(["ab", "abc"])
    assert matcher.push("xab", match=False) == ("x", False) and matcher.held == "ab"
    assert matcher.push("d") == ("abd", False), "a stop string wholly within min_tokens never ends it later"


def test_without_stop_strings_nothing_is_held():
    matcher = StopStringMatcher([])
    assert matcher.push("abc") == ("abc", False)
    assert matcher.flush() == ""


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("Hello world, héllo wörld!", "o w", "Hell"),  # spans the tokens "Hello" and " world"
        ("日本語 🦀 crab", "🦀 c", "日本語 "),  # starts inside a multi-byte character's tokens
        ("héllo wörld", "ö", "héllo w"),
        ("no match here", "xyz", "no match here"),
    ],
)
def test_text_stream_cuts_at_a_stop_string_across_token_boundaries(
    tokenizer: ModelTokenizer, text: str, stop: str, expected: str
):
    stream = TextStream(tokenizer, tokenizer.encode("Hi"), [stop])
    out, stopped = [], False
    for token_id in tokenizer.encode(text):
        piece, stopped = stream.push(token_id)
        out.append(piece)
        if stopped:
            break
    if not stopped:
        piece, stopped = stream.finish()
        out.append(piece)
    assert "".join(out) == expected
    assert stopped == (stop in text)


@given(st.text(alphabet="ab é日🦀", max_size=25), st.text(alphabet="ab é日🦀", min_size=1, max_size=4))
@settings(max_examples=80, deadline=None)
def test_text_stream_returns_the_text_before_the_first_stop_string(text: str, stop: str):
    tokenizer = ModelTokenizer(TOKENIZER_JSON)
    stream = TextStream(tokenizer, [], [stop])
    out, stopped = "", False
    for token_id in tokenizer.encode(text):
        piece, stopped = stream.push(token_id)
        out += piece
        if stopped:
            break
    if not stopped:
        piece, stopped = stream.finish()
        out += piece
    assert out == (text[: text.find(stop)] if stop in text else text)
    assert stopped == (stop in text)


TOKENIZER_JSON = byte_level_tokenizer().to_str()


def sentencepiece_style_tokenizer() -> ModelTokenizer:
    """Llama-2 style: "▁" for spaces, the first one stripped when decoding, bytes as <0xNN> tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in ["▁", *string.ascii_letters, *",.!?", "é", "ö"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "H"), ("e", "l"), ("el", "l"), ("▁H", "ell"), ("▁Hell", "o"), ("▁", "w"), ("o", "r"), ("▁w", "or")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return ModelTokenizer(tokenizer.to_str())


def test_the_sentencepiece_style_fixture_falls_back_to_bytes():
    tokenizer = sentencepiece_style_tokenizer()
    crab = tokenizer.encode("🦀", add_special_tokens=False)[1:]
    assert [tokenizer.tokenizer.id_to_token(t) for t in crab] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]


@pytest.mark.parametrize("text", ["Hello world 🦀 日本", "héllo wörld", "a  b"])
def test_sentencepiece_style_spaces_and_byte_fallback_stream_back(text: str):
    tokenizer = sentencepiece_style_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    # After a prompt, the completion's first space is kept: it separates the completion from the prompt.
    pieces = stream_text(tokenizer, tokenizer.encode("The fox", add_special_tokens=False), ids)
    assert "".join(pieces) == " " + text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    special = tokenizer.tokenizer.token_to_id("</s>")
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("The fox", add_special_tokens=False))
    streamed = [detokenizer.push(t) for t in [special, *ids, special]] + [detokenizer.flush()]
    assert "".join(streamed) == " " + text


def test_release_gives_back_a_held_stop_string_start_and_an_unfinished_character(tokenizer: ModelTokenizer):
    # An aborted generation: what was held back is final, and no stop string is matched in it (not even one the
    # unfinished character's U+FFFD would match, as finish() would).
    ids = tokenizer.encode("x ST🦀")[:-1]
    stream = TextStream(tokenizer, [], ["STOP", "\ufffd"])
    emitted = "".join(stream.push(t)[0] for t in ids)
    assert emitted == "x "
    released = stream.release()
    assert released.startswith("ST") and REPLACEMENT_CHAR in released
    assert emitted + released == tokenizer.decode(ids)
    assert stream.release() == ""
