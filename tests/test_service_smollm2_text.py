"""The scheduler's text handling on SmolLM2's own tokenizer and chat template (no model weights are used)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler_svc.core.detokenizer import REPLACEMENT_CHAR, TextStream
from scheduler_svc.core.tokenizer import ChatMessage, ModelTokenizer
from tests.model_fixtures import smollm2_folder  # noqa: F401

TEXTS = ["The café serves naïve crème brûlée.", "日本語のテキスト 🦀🎉 mixed", "Ünïcödé — “quotes” … ½"]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_folder: Path) -> ModelTokenizer:  # noqa: F811
    config = json.loads((smollm2_folder / "config.json").read_text())
    template = (smollm2_folder / "chat_template.jinja").read_text()
    return ModelTokenizer((smollm2_folder / "tokenizer.json").read_text(), template, config.get("bos_token_id"),
                          (config["eos_token_id"],))


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_smollm2_tokens_gives_back_the_text(smollm2_tokenizer: ModelTokenizer, text: str):
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(smollm2_tokenizer, smollm2_tokenizer.encode_chat([ChatMessage("user", "hi")]), [])
    pieces = [stream.push(t)[0] for t in ids]
    pieces.append(stream.finish()[0])
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_a_stop_string_across_smollm2_tokens(smollm2_tokenizer: ModelTokenizer):
    text = "日本語のテキスト 🦀🎉 mixed"
    stream = TextStream(smollm2_tokenizer, [], ["🦀🎉 m"])
    out = ""
    for token_id in smollm2_tokenizer.encode(text, add_special_tokens=False):
        piece, stopped = stream.push(token_id)
        out += piece
        if stopped:
            break
    assert (out, stopped) == ("日本語のテキスト ", True)


def test_chat_rendering_matches_transformers(smollm2_tokenizer: ModelTokenizer, smollm2_folder: Path):  # noqa: F811
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_folder)
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Bonjour 🦀"),
                ChatMessage("assistant", "Salut."), ChatMessage("user", "Ça va ?")]
    as_dicts = [{"role": m.role, "content": m.content} for m in messages]
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert smollm2_tokenizer.render_chat(messages, add_generation_prompt) == expected
    rendered = hf.apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=True)
    assert smollm2_tokenizer.encode_chat(messages) == hf(rendered, add_special_tokens=False)["input_ids"]
