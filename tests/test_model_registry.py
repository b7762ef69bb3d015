"""The embedded model converts once into $NANOSERVE_CACHE as a plain Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_svc.runtime.config import ModelConfig
from executor_svc.runtime.registry import DEFAULT_MODEL, resolve_model


@pytest.mark.slow
def test_embedded_model_converts_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    folder = resolve_model(DEFAULT_MODEL)
    assert folder == tmp_path / DEFAULT_MODEL
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL], "a temporary folder was left behind"
    config = ModelConfig.from_folder(folder)
    assert (config.architecture, config.vocab_size, config.num_layers) == ("LlamaForCausalLM", 49152, 30)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(DEFAULT_MODEL) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp, "the second start converted again"
