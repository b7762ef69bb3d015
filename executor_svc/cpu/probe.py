"""Chooses the CPU kernels at start-up: the C kernel or torch, per family and shape class (``choice.py``).

Each family runs on the loaded model's own shapes at each class's probe rows. Linear passes over the
model's own weights (the first gigabyte of them for the decode classes, since a decode step streams every
weight from memory; one decoder layer's for prefill, which is compute-bound); decode attention reads layer 0
of the real cache through random block tables, contexts of up to 512 tokens; prefill attention runs one
prompt of each class's length (``PREFILL_ATTENTION_TOKENS``) with nothing cached (its classes are of a
step's longest context). C and torch take turns for ``ROUNDS`` rounds and each keeps its fastest: a shared
machine's noise only adds time, and a slow spell once made the medians of rounds pick the slower side at 64
rows, and the cache kept that table. Torch is chosen only when at least ``MARGIN`` faster, so two kernels within
noise keep the C one and its numerics. The table is cached per machine (the key names the kernel build, which
names the CPU's flags) and measured again only when something in the key changes. A race that other processes kept
off the CPU (``BUSY_SHARE``) is logged as such: under the test suite's load one gave linear's ``prefill`` class to
torch on a Xeon where the C kernel runs it twice as fast, and that table served every later start, so ``make test``
measures into a cache of its own.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from executor_svc.attention.base import AttentionBackend, AttentionMetadata
from executor_svc.attention.cpu_backend import CpuAttention
from executor_svc.attention.torch_backend import TorchAttention
from executor_svc.cpu import choice as kernel_choice
from executor_svc.cpu import fused as cpu_fused
from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.cpu.choice import CLASSES, FAMILIES, PREFILL_ROWS, PROBE_ROWS, KernelChoice, shape_class
from executor_svc.cpu.cpuinfo import cpuinfo
from executor_svc.layers.activation import SiluAndMul
from executor_svc.layers.linear import LinearBase, cpu_linear_layers, drop_unused_copies, prepack_for_cpu
from executor_svc.layers.norm import RMSNorm
from executor_svc.layers.rotary import RotaryEmbedding
from executor_svc.runtime.distributed import broadcast_object, tp_rank, tp_size
from executor_svc.runtime.registry import cache_root

log = logging.getLogger("nanoserve.executor")

ROUNDS = 5
MARGIN = 0.05
MIN_SECONDS = 0.002  # timed calls per round: at least this long, so the timer's resolution does not count
ATTENTION_CONTEXT = 512
# Prefill attention is raced on one prompt per class, as long as the class's probe rows, but for ``prefill``
# (contexts past 256 tokens): where torch's flash kernel wins, it wins by more the longer the prompt, and on one of
# 512 tokens the race came out either way.
PREFILL_ATTENTION_TOKENS = {**PROBE_ROWS, "prefill": 1024}
PROBE_WEIGHT_BYTES = 1 << 30
# Below this share of the race's wall time on the CPU (its threads' CPU time over wall time times threads; spinning
# OpenMP threads count, so a quiet machine reads about 0.9), other processes took the cores: a 2-thread kernel waits
# at its barrier whenever one thread is off the CPU, and the race can pick the slower side.
BUSY_SHARE = 0.75

Calls = tuple[Callable[[], object], Callable[[], object]]  # (C kernel, torch)
Probe = Callable[[int], Calls]


# What a table's measurement depends on besides the C kernels (the build's id names those): the probes, the
# classes and the torch side of each race. A table measured with other versions of them is measured again.
MEASURED_WITH = [Path(__file__).parent.parent / name for name in (
    "cpu/probe.py", "cpu/choice.py", "layers/linear.py", "cpu/fused.py", "layers/norm.py",
    "layers/activation.py", "layers/rotary.py", "attention/torch_backend.py", "attention/cpu_backend.py",
)]


def choice_cache(parts: Iterable[object]) -> Path:
    """Where this machine's table for ``parts`` (dtype, threads, model shape, ...) is cached: the key also names
    the kernel build (which names the CPU's flags), the CPU's model, torch, the sources in ``MEASURED_WITH`` and the
    oneDNN ISA limit (``ONEDNN_MAX_CPU_ISA`` can turn AMX off)."""
    sources = hashlib.sha256(b"".join(path.read_bytes() for path in MEASURED_WITH)).hexdigest()[:16]
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA"))
    return kernel_choice.cache_path(cache_root() / "kernels", (
        cpu_kernels.library_id(), cpuinfo("model name"), torch.__version__, sources, isa, *parts))


def known_choice(flag: str, cache: Path) -> KernelChoice | None:
    """The table when no measurement is needed (the flag names every family and class, or it is cached)."""
    ways = kernel_choice.parse_override(flag)
    if cpu_kernels.kernel_library() is None:
        return KernelChoice.uniform("torch", source="no C kernels on this machine")
    if kernel_choice.covers_all(ways):
        return kernel_choice.ALL_C.with_ways(ways, source=f"--cpu-kernels {flag}")
    cached = kernel_choice.load_cached(cache)
    return None if cached is None else cached.with_ways(ways)


def agreed(choice: KernelChoice | None) -> KernelChoice | None:
    """Rank 0's table on every rank. Tensor-parallel ranks measure at once (as they will run), each its own shards,
    and could choose apart; they run, and cache, one table."""
    return choice if tp_size() == 1 else broadcast_object(choice)


def settle(model: nn.Module, backend: AttentionBackend, known: KernelChoice | None, flag: str, cache: Path,
           dtype: torch.dtype) -> KernelChoice:
    """Measure unless ``known``, give the linear layers the weight copies the table reads (a model loaded for
    measuring has only its dense weights), hand the table to the layers and the backend, log."""
    choice = known
    if choice is None:
        raced = probe_layers(model)
        prepack_for_cpu(model, c_kernel=True, torch_copy=True, layers=raced)
        started, cpu_started = time.perf_counter(), time.process_time()
        measured = agreed(measure(model, backend, dtype))
        share = (time.process_time() - cpu_started) / ((time.perf_counter() - started) * torch.get_num_threads())
        if share < BUSY_SHARE:
            log.warning("the CPU kernel race ran while other processes held the CPU (its threads ran %.0f%% of the "
                        "time): its table, cached in %s, may not be this machine's best; delete that file to measure "
                        "again on a quiet machine", 100 * share, cache)
        if tp_rank() == 0:
            try:
                kernel_choice.save(cache, measured)
            except OSError as e:  # a read-only or full cache: this start uses the table, the next measures again
                log.warning("could not cache the CPU kernel choice in %s (%s)", cache, e)
        choice = measured.with_ways(kernel_choice.parse_override(flag))
        raced_ids = {id(m) for m in raced}
        rest = [m for m in cpu_linear_layers(model) if id(m) not in raced_ids]
        prepack_for_cpu(model, c_kernel=choice.uses("linear", "c"), torch_copy=choice.uses("linear", "torch"),
                        layers=rest)
    have = available(model, backend, dtype)
    choice = choice.with_ways({(f, c): "torch" for f in FAMILIES if f not in have for c in CLASSES})
    install(model, backend, choice)
    log.info("CPU kernels for rows %s per call (prefill attention: its longest context): %s (%s)", "/".join(CLASSES),
             choice.describe(), choice.source)
    return choice


def install(model: nn.Module, backend: AttentionBackend, choice: KernelChoice) -> None:
    for module in model.modules():
        if isinstance(module, RMSNorm | SiluAndMul | RotaryEmbedding) or hasattr(module, "packed_weight"):
            module.kernels = choice
    if isinstance(backend, CpuAttention):
        backend.kernels = choice
    drop_unused_copies(model, choice)


def available(model: nn.Module, backend: AttentionBackend, dtype: torch.dtype) -> set[str]:
    """The families with a C kernel for this model on this machine."""
    if cpu_kernels.kernel_library() is None or dtype not in cpu_fused.DTYPES:
        return set()
    have = {"rms_norm", "silu_and_mul", "rotary"}
    if any(m.packed_weight is not None for m in cpu_linear_layers(model)):
        have.add("linear")
    if isinstance(backend, CpuAttention):
        have.add("decode_attention")
        attention = _first_attention(model)
        if attention is not None and cpu_kernels.kernel_library().prefill_attention_supported(attention.head_dim):
            have.add("prefill_attention")
    return have


def measure(model: nn.Module, backend: AttentionBackend, dtype: torch.dtype) -> KernelChoice:
    """Race every family with a C kernel at every class; the others are torch's."""
    started, ways, timings = time.perf_counter(), {}, {}
    for family, probe in probes_for(model, backend, dtype).items():
        timings[family] = {}
        for klass in CLASSES:
            if family == "decode_attention" and klass == "prefill":
                continue  # a decode batch past 256 sequences is rare: it takes the 33+ choice below
            c_ms, torch_ms = race(*probe(PROBE_ROWS[klass]))
            timings[family][klass] = (c_ms, torch_ms)
            ways[family, klass] = "torch" if torch_ms < c_ms * (1 - MARGIN) else "c"
        if family == "decode_attention":
            ways[family, "prefill"] = ways[family, "33+"]
    seconds = time.perf_counter() - started
    return KernelChoice(KernelChoice.uniform("torch").with_ways(ways).table, f"measured in {seconds:.1f} s", timings)


def race(c_call: Callable[[], object], torch_call: Callable[[], object]) -> tuple[float, float]:
    """Fastest milliseconds per call of each over ``ROUNDS`` rounds, taking turns after one warm-up call each."""
    c_call(), torch_call()
    c_ms, torch_ms = [], []
    for _ in range(ROUNDS):
        c_ms.append(_ms_per_call(c_call))
        torch_ms.append(_ms_per_call(torch_call))
    return min(c_ms), min(torch_ms)


def _ms_per_call(call: Callable[[], object]) -> float:
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < MIN_SECONDS or calls == 0:
        call()
        calls += 1
    return elapsed / calls * 1e3


def probes_for(model: nn.Module, backend: AttentionBackend, dtype: torch.dtype) -> dict[str, Probe]:
    """Each family with a C kernel here as rows -> (C call, torch call), on this model's shapes."""
    have, probes = available(model, backend, dtype), {}
    attention = _first_attention(model)
    if "linear" in have and (linear := _linear_probe(model, dtype)):
        probes["linear"] = linear
    if "decode_attention" in have and attention is not None and attention.k_cache.dtype == dtype:
        probes["decode_attention"] = _attention_probe(attention, backend, dtype)
    if "prefill_attention" in have and attention is not None and attention.k_cache.dtype == dtype:
        probes["prefill_attention"] = _prefill_attention_probe(attention, backend, dtype)
    norm = widest_norm(model)
    rotary = next((m for m in model.modules() if isinstance(m, RotaryEmbedding)), None)
    gate_up = next((m for name, m in model.named_modules() if name.endswith("gate_up_proj")), None)
    if "rms_norm" in have and norm is not None:
        probes["rms_norm"] = _rms_norm_probe(norm, dtype)
    if "silu_and_mul" in have and gate_up is not None:
        probes["silu_and_mul"] = _silu_probe(sum(gate_up.shard_sizes), dtype)
    if "rotary" in have and rotary is not None and attention is not None:
        probes["rotary"] = _rotary_probe(rotary, attention, dtype)
    return probes


def widest_norm(model: nn.Module) -> RMSNorm | None:
    """The hidden-size norm the table steers, not a head-wide one that comes first (Qwen3's q_norm, which runs in
    torch whatever the table says)."""
    return max((m for m in model.modules() if isinstance(m, RMSNorm)), key=lambda m: m.weight.shape[0], default=None)


def probe_layers(model: nn.Module) -> list[LinearBase]:
    """The linear layers the race runs on, and the only ones holding both weight copies while it runs (a first
    start needs little memory beyond the model's): the first in the model's order until their weights reach
    ``PROBE_WEIGHT_BYTES``, or all of a smaller model's. That is past the last-level cache of all but the largest
    CPUs, so the decode classes stream weights from memory as a whole decode step does."""
    raced, total = [], 0
    for module in cpu_linear_layers(model):
        if total >= PROBE_WEIGHT_BYTES:
            break
        raced.append(module)
        total += module.weight.numel() * module.weight.element_size()
    return raced


def _first_attention(model: nn.Module) -> nn.Module | None:
    layers = model.attention_layers() if hasattr(model, "attention_layers") else []
    return layers[0] if layers else None


def _linear_probe(model: nn.Module, dtype: torch.dtype) -> Probe | None:
    layers = [m for m in cpu_linear_layers(model) if m.packed_weight is not None]
    first = [m for name, m in model.named_modules() if ".layers.0." in f".{name}." and m in layers]
    if any(m.onednn_weight is None and m.weight.numel() == 0 for m in layers):
        return None  # no torch copy to race the C one against

    def at(rows: int) -> Calls:
        chosen = layers if rows < PREFILL_ROWS or not first else first
        inputs = {k: torch.randn(rows, k).to(dtype) for k in {m.packed_weight.k for m in chosen}}
        return (lambda: [m.packed_weight.linear(inputs[m.packed_weight.k], None) for m in chosen],
                lambda: [m.torch_matmul(inputs[m.packed_weight.k], None) for m in chosen])

    return at


def _attention_probe(attention: nn.Module, backend: CpuAttention, dtype: torch.dtype) -> Probe:
    k_cache, v_cache = attention.k_cache, attention.v_cache
    num_blocks, block_size, _, head_dim = k_cache.shape
    num_heads, scale = attention.num_heads, attention.scale
    gen = torch.Generator().manual_seed(0)

    def at(rows: int) -> Calls:
        lengths = torch.randint(32, ATTENTION_CONTEXT + 1, (rows,), generator=gen)
        width = -(-ATTENTION_CONTEXT // block_size)
        tables = torch.randint(0, num_blocks, (rows, width), generator=gen, dtype=torch.int32)
        meta = AttentionMetadata(False, torch.full((rows,), -1), tables, context_lens=lengths.int())
        q = torch.randn(rows, num_heads, head_dim, generator=gen).to(dtype)
        return (lambda: backend.kernel_decode(q, k_cache, v_cache, meta, scale),
                lambda: TorchAttention.decode(backend, q, k_cache, v_cache, meta, scale))

    return at


def prefill_batch(
    rows: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator,
    prompt_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q, k, v (views of one qkv projection, as the model hands them over) and metadata of a prefill of ``rows``
    tokens, in requests of at most ``prompt_tokens`` with nothing cached."""
    lengths = [min(prompt_tokens, rows - start) for start in range(0, rows, prompt_tokens)]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    tables = torch.zeros(len(lengths), 1, dtype=torch.int32)
    meta = AttentionMetadata(True, torch.full((rows,), -1), tables, cu, cu, max(lengths), max(lengths))
    return q.view(rows, num_heads, head_dim), k.view(rows, -1, head_dim), v.view(rows, -1, head_dim), meta


def _prefill_attention_probe(attention: nn.Module, backend: CpuAttention, dtype: torch.dtype) -> Probe:
    k_cache, v_cache, scale = attention.k_cache, attention.v_cache, attention.scale
    gen = torch.Generator().manual_seed(0)

    def at(rows: int) -> Calls:  # one prompt: the class is of the longest context
        tokens = PREFILL_ATTENTION_TOKENS[shape_class(rows)]
        q, k, v, meta = prefill_batch(tokens, attention.num_heads, attention.num_kv_heads, attention.head_dim, dtype,
                                      gen, prompt_tokens=tokens)
        return (lambda: backend.kernel_prefill(q, k, v, k_cache, v_cache, meta, scale),
                lambda: TorchAttention.prefill(backend, q, k, v, k_cache, v_cache, meta, scale))

    return at


def _rms_norm_probe(norm: RMSNorm, dtype: torch.dtype) -> Probe:
    def at(rows: int) -> Calls:
        x, residual = torch.randn(rows, norm.weight.shape[0]).to(dtype), torch.randn(rows, norm.weight.shape[0])
        residual = residual.to(dtype)
        # Both update a copy of the residual, as the decoder's running one is updated in place.
        return (lambda: cpu_fused.rms_norm(x, residual.clone(), norm.weight, norm.eps),
                lambda: norm.torch_forward(x, residual.clone()))

    return at


def _silu_probe(width: int, dtype: torch.dtype) -> Probe:
    def at(rows: int) -> Calls:
        x = torch.randn(rows, width).to(dtype)
        return lambda: cpu_fused.silu_and_mul(x), lambda: SiluAndMul.torch_forward(x)

    return at


def _rotary_probe(rotary: RotaryEmbedding, attention: nn.Module, dtype: torch.dtype) -> Probe:
    heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, rotary.cos.shape[1]

    def at(rows: int) -> Calls:
        positions = torch.randint(0, rotary.cos.shape[0], (rows,))
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(dtype)
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
        return (lambda: cpu_fused.rotary(positions, q, k, rotary.cos, rotary.sin),
                lambda: rotary.torch_forward(positions, q, k))

    return at
