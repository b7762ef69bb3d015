"""A Hugging Face folder's weights as the executor meets them at start: which files are the model's (the index's, as
vLLM and transformers read them), and weights it cannot read refused in one line, not a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor_svc.runtime.config import ExecutorOptions, UnsupportedModel
from executor_svc.runtime.hf_folder import weight_files
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.runtime.start_checks import FlagError, check_model
from tests.model_fixtures import tiny_model_folders  # noqa: F401
from tests.service_fixtures import ROOT, free_port


def copied(tiny_model_folders: dict[str, Path], tmp_path: Path) -> Path:  # noqa: F811
    return Path(shutil.copytree(tiny_model_folders["llama"], tmp_path / "model"))


def test_a_folder_of_pytorch_bin_weights_is_refused_by_the_start_checks_naming_model(
    tiny_model_folders: dict[str, Path], tmp_path: Path  # noqa: F811
):
    folder = copied(tiny_model_folders, tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"pickled weights")
    with pytest.raises(FlagError, match=r"^--model: .* has no \*\.safetensors weights \(only PyTorch pytorch_model"):
        check_model(str(folder), None)


def test_only_the_files_the_index_names_are_loaded(tiny_model_folders: dict[str, Path], tmp_path: Path):  # noqa: F811
    folder = copied(tiny_model_folders, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    # What a merged-adapter or Mistral-format folder leaves beside the model: not the model's tensors.
    save_file({"base_model.model.lora_A.weight": torch.zeros(2, 2)}, folder / "adapter_model.safetensors")
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, folder / "consolidated.safetensors")
    assert weight_files(folder) == [folder / "model-00001-of-00001.safetensors"]
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(folder), kv_cache_memory=1 << 20, threads=1))
    assert executor.get_info().architecture == "LlamaForCausalLM"


def test_without_an_index_model_safetensors_alone_is_the_model(tiny_model_folders: dict[str, Path],  # noqa: F811
                                                               tmp_path: Path):
    folder = copied(tiny_model_folders, tmp_path)
    save_file({"base_model.model.lora_A.weight": torch.zeros(2, 2)}, folder / "adapter_model.safetensors")
    assert weight_files(folder) == [folder / "model.safetensors"]


def test_an_index_naming_a_missing_file_is_refused_naming_it(tmp_path: Path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "part-2.safetensors"}}))
    with pytest.raises(UnsupportedModel, match="names part-2.safetensors, which is not in"):
        weight_files(tmp_path)


def test_weights_refused_while_loading_end_the_start_in_one_line(tiny_model_folders: dict[str, Path],  # noqa: F811
                                                                 tmp_path: Path):
    folder = copied(tiny_model_folders, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    run = subprocess.run(
        [sys.executable, "-m", "executor_svc", "--model", str(folder), "--device", "cpu", "--dtype", "float32",
         "--kv-cache-memory", "1MiB", "--cpu-kernels", "torch", "--port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("nanoserve-executor: error: checkpoint in ") and "model.layers.1.mlp.down_proj" in last
