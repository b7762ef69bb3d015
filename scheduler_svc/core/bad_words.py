"""vLLM's ``bad_words``: each word turned into the token-id sequences its rule bans, where a request enters.

The scheduler holds the tokenizer, so the words are tokenized here, once; the executor receives only the id
sequences and bans each one's last token as it samples (``executor_svc/sample/token_masks.py``), where every
token of the completion is known, proposals and steps in flight included.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.tokenizer import ModelTokenizer

# vLLM's bounds (VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS): sequences once tokenized, and their tokens
# summed. They bound what the executor matches for a request at every step.
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOKENS = 1024


def bad_words_token_ids(words: Sequence[str], tokenizer: ModelTokenizer | None) -> list[list[int]]:
    """The sequences vLLM makes of ``words``: each word (repeats dropped) as written, its leading whitespace
    stripped, then after one space, that form kept only where it starts with another token and has as many
    (a word at the start of the text and one after a space are different tokens in most vocabularies)."""
    if not words:
        return []
    if tokenizer is None:
        raise InvalidRequest("bad_words", "bad words need a tokenizer and this executor has none")
    if any(not word for word in words):
        raise InvalidRequest("bad_words", "bad words must not be empty")
    sequences = []
    for word in dict.fromkeys(words):
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise InvalidRequest("bad_words", f"{word!r} encodes to no tokens")
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def check_bad_words(sequences: Sequence[Sequence[int]]) -> None:
    """The bounds, whoever tokenized the words (the in-process API takes sequences)."""
    if len(sequences) > MAX_BAD_WORDS:
        raise InvalidRequest("bad_words", f"at most {MAX_BAD_WORDS} token sequences once tokenized (a word may "
                                          f"give two), got {len(sequences)}")
    if any(not sequence for sequence in sequences):
        raise InvalidRequest("bad_words", "a bad word's token sequence is empty")
    total = sum(map(len, sequences))
    if total > MAX_BAD_WORDS_TOKENS:
        raise InvalidRequest("bad_words", f"at most {MAX_BAD_WORDS_TOKENS} tokens in all once tokenized, got {total}")


def first_banned(completion: Sequence[int], sequences: Sequence[Sequence[int]]) -> int | None:
    """The first position of ``completion`` holding a token the sequences ban there (it ends one of them, the
    ones before it being the completion's), or None: a completion sampled under them has none."""
    by_last: dict[int, list[tuple[int, ...]]] = {}
    for sequence in sequences:
        by_last.setdefault(sequence[-1], []).append(tuple(sequence[:-1]))
    for i, token_id in enumerate(completion):
        for prefix in by_last.get(token_id, ()):
            if len(prefix) <= i and tuple(completion[i - len(prefix) : i]) == prefix:
                return i
    return None
