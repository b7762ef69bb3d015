"""The executor's flags checked against this machine and the model before a weight is read, so that a value it
cannot run ends the start with one line naming its flag, not a traceback from deep inside the model's loading."""

from __future__ import annotations

from typing import TYPE_CHECKING

from executor_svc.runtime.config import ExecutorOptions, ModelConfig, UnsupportedModel
from executor_svc.runtime.hf_folder import weight_files
from executor_svc.runtime.registry import resolve_model

if TYPE_CHECKING:
    import torch

DEVICE_TYPES = ("cpu", "cuda")


class FlagError(ValueError):
    """A flag's value the executor cannot run here; the message starts with the flag."""


def check_options(options: ExecutorOptions) -> None:
    """FlagError for a --device, --attention-backend, --model or --max-model-len the executor cannot run."""
    device = check_device(options.resolved_device())
    check_attention_backend(options.attention_backend, device)
    check_model(options.model, options.max_model_len)


def check_device(name: str) -> torch.device:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:  # torch's own message lists every device type it knows, most of which this cannot run
        raise FlagError(f"--device {name!r} is not a device; give cpu, cuda or cuda:N") from None
    if device.type not in DEVICE_TYPES:
        raise FlagError(f"--device {name!r}: the executor runs on {' or '.join(DEVICE_TYPES)} only")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise FlagError(f"--device {name!r}: no CUDA device is available here; give cpu")
        if device.index is not None and device.index >= count:
            raise FlagError(f"--device {name!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def check_attention_backend(name: str | None, device: torch.device) -> None:
    if name is None or name == "auto":
        return
    from executor_svc.attention import BACKENDS, available_backends

    if name not in BACKENDS:
        raise FlagError(f"--attention-backend {name!r} is not a backend; choose one of {', '.join(BACKENDS)} "
                        "(or leave it out: the best for the device)")
    choices = available_backends(device)
    if name not in choices:
        raise FlagError(f"--attention-backend {name!r} is not available on {device}; choose one of "
                        f"{', '.join(choices)}")


def check_model(model: str, max_model_len: int | None) -> None:
    """The model's config.json, and that it has weights this executor reads: they are read once every flag is known
    to be good."""
    try:
        folder = resolve_model(model)
        config = ModelConfig.from_folder(folder)
        if max_model_len is not None and max_model_len > config.max_position_embeddings:
            raise FlagError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
                            f"{config.max_position_embeddings}; it may only shrink the model's context")
        weight_files(folder)
    except UnsupportedModel as e:
        raise FlagError(f"--model: {e}") from None
