"""``nanoserve-executor``: load a model and serve the executor contract over gRPC.

Every flag can also come from ``NANOSERVE_<FLAG>`` (e.g. ``NANOSERVE_KV_CACHE_MEMORY``);
a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence

from common.executor import LoraRefused
from common.flags import EnvFlags, boolean, byte_size, port, positive_int, share
from common.security import TLSConfig
from executor_svc.cpu.choice import parse_override
from executor_svc.cpu.openmp import set_wait_policy
from executor_svc.runtime.config import DTYPES, ExecutorOptions, UnsupportedModel
from executor_svc.runtime.registry import DEFAULT_MODEL

log = logging.getLogger("nanoserve.executor")

def cpu_kernels_flag(text: str) -> str:
    try:
        parse_override(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def lora_modules(text: str) -> dict[str, str]:
    """``name=path`` items, separated by commas -> {name: path}."""
    modules = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"an adapter is NAME=PATH, got {item!r}")
        if name in modules:
            raise argparse.ArgumentTypeError(f"adapter name {name!r} is given twice")
        modules[name] = path
    return modules


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanoserve-executor", description=__doc__.splitlines()[0])
    flags = EnvFlags(p, os.environ if env is None else env)
    add = flags.add
    add("--model", str, DEFAULT_MODEL, "embedded model name or a local Hugging Face folder")
    add("--host", str, "127.0.0.1", "address to bind")
    add("--port", port, 50052, "port to bind")
    add("--device", str, None, "torch device, e.g. cpu, cuda, cuda:1 (None: cuda when available, else cpu)")
    add("--dtype", str, None,
        "compute dtype (None: bfloat16 on CUDA and on CPUs with avx512_bf16 or amx_bf16, else float32)", choices=DTYPES)
    add("--tensor-parallel-size", positive_int, 1, "ranks in the tensor-parallel group")
    add("--block-size", positive_int, 16, "tokens per KV-cache block")
    add("--kv-cache-memory", byte_size, None,
        "KV-cache bytes per rank, e.g. 2GiB (None: 1GiB on CPU, the free memory share on CUDA)")
    add("--gpu-memory-utilization", share, 0.9, "share of GPU memory to fill, KV cache included, in (0, 1]")
    add("--attention-backend", str, None, "cpu, torch, triton or flash_attn (None: the best for the device)")
    add("--max-model-len", positive_int, None, "longest context in tokens (None: the model's)")
    add("--threads", positive_int, None, "torch threads per rank on CPU (None: torch's choice)")
    add("--enforce-eager", boolean, False, "never capture CUDA graphs")
    add("--cpu-kernels", cpu_kernels_flag, "auto",
        "CPU kernels: auto (measured at start-up, cached per machine), c, torch, or family[:class]=c|torch items")
    add("--cpu-decode-stack", boolean, True, "CPU: run a decode step's decoder layers in one C call where they fit, "
        "or their C parts in four calls a layer between torch projections (the same kernels and tokens, without "
        "~10 Python calls a layer)")
    add("--yield-cpu", boolean, False, "on the CPU, run gRPC's and the other helper threads in SCHED_IDLE, so that "
        "they never preempt the forward pass: more offline throughput, a later first token (with the scheduler's)")
    add("--lora-modules", lora_modules, {}, "LoRA adapters to serve, NAME=PATH items (PEFT adapter folders), "
        "space- or comma-separated; a request names one as its model", nargs="+")
    add("--max-lora-rank", positive_int, 16, "highest LoRA adapter rank served")
    add("--runtime-lora", boolean, False, "allow loading and unloading LoRA adapters while serving (the "
        "LoadLoraAdapter and UnloadLoraAdapter RPCs; one rank only)")
    add("--speculative-model", str, None, "draft model for speculative decoding, an embedded name or a local "
        "Hugging Face folder with the served model's tokenizer (its own KV cache shares the blocks)")
    add("--speculative-draft-layers", positive_int, None, "draft model for speculative decoding made of the served "
        "model's first N decoder layers, its final norm and LM head (an early exit: no weights or KV of its own)")
    add("--tls-cert", str, "", "PEM certificate chain (with --tls-key: serve TLS)")
    add("--tls-key", str, "", "PEM private key of --tls-cert")
    add("--tls-ca", str, "", "PEM CA: only a scheduler with a client certificate it signed may connect (mutual TLS)")
    return p


def options_from_args(args: argparse.Namespace) -> ExecutorOptions:
    return ExecutorOptions(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
        threads=args.threads,
        enforce_eager=args.enforce_eager,
        cpu_kernels=args.cpu_kernels,
        cpu_decode_stack=args.cpu_decode_stack,
        lora_modules=_merged(args.lora_modules),
        max_lora_rank=args.max_lora_rank,
        runtime_lora=args.runtime_lora,
        speculative_model=args.speculative_model,
        speculative_draft_layers=args.speculative_draft_layers,
    )


def _merged(modules: dict[str, str] | list[dict[str, str]]) -> dict[str, str]:
    """One mapping from the flag's items (a list of them from the command line, one from the environment)."""
    if isinstance(modules, dict):
        return modules
    merged: dict[str, str] = {}
    for part in modules:
        twice = merged.keys() & part.keys()
        if twice:
            raise argparse.ArgumentTypeError(f"adapter name {sorted(twice)[0]!r} is given twice")
        merged.update(part)
    return merged


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except argparse.ArgumentTypeError as e:
        parser.error(f"--lora-modules: {e}")
    from executor_svc.runtime.start_checks import FlagError, check_options

    try:
        check_options(options)
    except FlagError as e:  # a value this machine or model cannot run: one line, no traceback
        raise SystemExit(f"{parser.prog}: error: {e}") from None
    try:
        tls = TLSConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as e:
        parser.error(str(e))
    set_wait_policy()
    from executor_svc.runtime.model_executor import ModelExecutor
    from executor_svc.service import serve

    try:
        executor = ModelExecutor(options)
    except LoraRefused as e:  # an adapter of --lora-modules that does not fit: say which and why
        parser.error(str(e))
    except UnsupportedModel as e:  # weights the checks before could not see (a tensor missing or out of place)
        raise SystemExit(f"{parser.prog}: error: {e}") from None
    info = executor.get_info()
    log.info(
        "model %s (%s) on %s, %s, %d KV blocks of %d tokens, attention %s, tensor-parallel %d",
        info.model_id, info.architecture, info.device, info.dtype, info.num_blocks, info.block_size,
        info.attention_backend, info.tensor_parallel_size,
    )
    try:
        serve(executor, args.host, args.port, tls=tls, yield_helpers=args.yield_cpu)
    finally:
        executor.close()


if __name__ == "__main__":
    main()
