"""What a Hugging Face model folder holds beside config.json, read at start as transformers and vLLM read it: which
weight files are the model's, the tokenizer files the handshake hands the scheduler (which has no model files), and
the request defaults of generation_config.json."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import fields
from pathlib import Path

from common.sampling import GenerationDefaults
from common.step import SpecialTokens
from executor_svc.runtime.config import UnsupportedModel, special_token_text, tokenizer_config

log = logging.getLogger("nanoserve.executor")

INDEX = "model.safetensors.index.json"


def weight_files(folder: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else model.safetensors alone where it is there,
    else every ``*.safetensors``. A stray adapter_model.safetensors or consolidated.safetensors is not the model's."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UnsupportedModel(f"{index} is not a safetensors index (a weight_map of tensor -> file)") from None
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise UnsupportedModel(f"{index} names {missing[0]}, which is not in {folder}")
        return [folder / name for name in names]
    single = folder / "model.safetensors"
    files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(path.name for path in folder.glob("pytorch_model*.bin"))
        only = f" (only PyTorch {bins[0]}, which is not read: save the model as safetensors)" if bins else ""
        raise UnsupportedModel(f"{folder} has no *.safetensors weights{only}")
    return files


def read_chat_template(folder: Path) -> str:
    """chat_template.jinja (transformers 5) or tokenizer_config.json's chat_template: a string, or a list of named
    templates of which the "default" one is used, as transformers uses it."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = (tokenizer_config(folder) or {}).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else ""


def read_tokenizer_json(folder: Path) -> str:
    """tokenizer.json, or "" with a warning: the scheduler then refuses text and chat prompts."""
    path = folder / "tokenizer.json"
    if path.is_file():
        return path.read_text()
    sentencepiece = folder / "tokenizer.model"
    why = (f"; its SentencePiece {sentencepiece.name} is not converted (that is not supported): save the tokenizer "
           "as tokenizer.json" if sentencepiece.is_file() else "")
    log.warning("%s has no tokenizer.json%s. Text and chat requests will be refused; send token ids", folder, why)
    return ""


def special_tokens(folder: Path, tokenizer_json: str, ids: dict[str, int | None]) -> SpecialTokens | None:
    """The tokenizer's own special tokens (what transformers renders in a chat template): each as
    tokenizer_config.json gives it, else special_tokens_map.json (where older checkpoints keep them), else the token
    of its id in ``ids`` (config.json's); one either file gives as null is none. None without either file."""
    path = folder / "special_tokens_map.json"
    configs = [c for c in (tokenizer_config(folder), json.loads(path.read_text()) if path.is_file() else None) if c]
    if not configs:
        return None
    texts, by_id = {}, {name: token_id for name, token_id in ids.items() if token_id is not None}
    for name in (field.name for field in fields(SpecialTokens)):
        given = next((config for config in configs if name in config), None)
        if given is not None:
            texts[name] = special_token_text(given[name])
            by_id.pop(name, None)
    if by_id and tokenizer_json:  # parsed once, and only where a token comes from its id
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(tokenizer_json)
        texts.update((name, tokenizer.id_to_token(token_id)) for name, token_id in by_id.items())
    return SpecialTokens(**texts)


# generation_config.json key -> (request field, whether a value is in range), the keys vLLM takes.
GENERATION_KEYS = {
    "temperature": ("temperature", lambda v: math.isfinite(v) and v >= 0),
    "top_p": ("top_p", lambda v: 0 < v <= 1),
    "top_k": ("top_k", lambda v: isinstance(v, int) and v >= 0),
    "min_p": ("min_p", lambda v: 0 <= v <= 1),
    "repetition_penalty": ("repetition_penalty", lambda v: math.isfinite(v) and v > 0),
    "max_new_tokens": ("max_tokens", lambda v: isinstance(v, int) and v >= 1),
}


def generation_defaults(folder: Path) -> GenerationDefaults | None:
    """The request defaults generation_config.json gives; None where it gives none. A value out of range is
    skipped with a warning, rather than refusing every request that leaves its field unset."""
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    taken = {}
    for key, (name, valid) in GENERATION_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
            log.warning("%s: %s %r is out of range; requests keep the scheduler's default", path, key, value)
            continue
        taken[name] = value
    return GenerationDefaults(**taken) if taken else None
