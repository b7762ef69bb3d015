"""The CPU's C kernels against the torch code they replace, at W1's sizes (SmolLM2-135M), in one process.

- ``linear``: one decode step's linear layers (30 layers of qkv, o, gate-up and down, plus the LM head,
  each layer its own weights so that they stream from memory as in the model) at ``--rows`` rows; the
  peer is the executor's torch path (oneDNN with weights in its own layout, ``onednn_copy``; ``F.linear``
  where that has none, as for bfloat16 on a CPU without native bfloat16; ``--dense-torch``: always ``F.linear``).
  The packed weights lie in one region on huge pages, as the executor's; ``--small-pages``: each on its own.
- ``decode_attention``: one layer of paged decode for 64 requests of context 32-512 (9 query and 3 KV
  heads of 64, block size 16, in a cache much larger than the CPU's caches, each call on blocks the call before
  did not read, as the layers of a step do); the peer is the ``torch`` attention backend.
- ``prefill_attention``: one layer of causal prefill of ``--rows`` tokens in prompts of up to ``--prompt-tokens``
  (default 128), nothing cached; the peer is the ``torch`` backend (SDPA per request).
- ``rms_norm``, ``silu_and_mul``, ``rotary``: one call at ``--rows`` rows; the peer is the layer's torch code.

Each figure is the median of ``--repeats`` timings, peers taking turns; ``ratio`` is torch's time over the
kernel's. Then the table the executor itself chooses by on this machine for W1's model at ``--dtype``
(``executor_svc/cpu/probe.py``: measured at its start-up, or read from this machine's cache). JSON:
``{kernel}_{rows}_ms`` and ``{kernel}_{rows}_torch_ms`` per row, and ``choice`` ({family: {class: "c" or
"torch"}}).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from executor_svc.cpu.openmp import set_wait_policy

set_wait_policy()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import print_table, progress, write_json  # noqa: E402
from executor_svc.attention.base import AttentionMetadata  # noqa: E402
from executor_svc.attention.cpu_backend import CpuAttention  # noqa: E402
from executor_svc.attention.torch_backend import TorchAttention  # noqa: E402
from executor_svc.cpu import fused as cpu_fused  # noqa: E402
from executor_svc.cpu import kernels as cpu_kernels  # noqa: E402
from executor_svc.cpu.choice import CLASSES, FAMILIES, KernelChoice  # noqa: E402
from executor_svc.cpu.huge_pages import slices_on_huge_pages  # noqa: E402
from executor_svc.cpu.probe import prefill_batch  # noqa: E402
from executor_svc.layers.linear import PackedWeight, onednn_copy  # noqa: E402
from executor_svc.layers.norm import RMSNorm  # noqa: E402
from executor_svc.layers.rotary import RotaryEmbedding, rotate_half  # noqa: E402
from executor_svc.runtime.config import ExecutorOptions  # noqa: E402
from executor_svc.runtime.model_runner import ModelRunner  # noqa: E402
from executor_svc.runtime.registry import DEFAULT_MODEL, resolve_model  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
LAYER_SHAPES = [(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
                (HIDDEN, INTERMEDIATE)]

Peers = tuple[Callable[[], object], Callable[[], object]]  # (kernel, torch)
PROMPT_TOKENS = 128  # prefill_attention's prompts unless --prompt-tokens


def linear_peers(dtype: torch.dtype, dense: bool = False, small_pages: bool = False) -> Callable[[int], Peers]:
    """``dense``: torch reads the dense weights through ``F.linear``, as the executor's bfloat16 did before it kept
    oneDNN's copy (A/B of that copy on a new CPU). ``small_pages``: each packed weight in its own allocation, as
    before the executor put them on huge pages (A/B of those)."""
    shapes = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    dense_weights = [(torch.randn(n, k) / k**0.5).to(dtype) for n, k in shapes]
    # one region on huge pages, in step order, as the executor packs them (prepack_for_cpu)
    regions = [None] * len(shapes) if small_pages else slices_on_huge_pages(
        [PackedWeight.packed_bytes(w) for w in dense_weights])
    weights = []
    for w, region in progress(list(zip(dense_weights, regions, strict=True)), desc="packing weights"):
        onednn = None if dense else onednn_copy(w)
        weights.append((PackedWeight.pack(w, region), w if onednn is None else onednn))

    def torch_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if w.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return F.linear(x, w)

    def at(rows: int) -> Peers:
        inputs = {k: torch.randn(rows, k).to(dtype) for k in (HIDDEN, INTERMEDIATE)}

        def ours() -> None:
            for packed, _ in weights:
                packed.linear(inputs[packed.k], None)

        def theirs() -> None:
            for packed, w in weights:
                torch_linear(inputs[packed.k], w)

        return ours, theirs

    return at


def decode_attention_peers(dtype: torch.dtype) -> Callable[[int], Peers]:
    gen = torch.Generator().manual_seed(0)
    num_blocks = 16384  # 400 MB of float32 K and V: far past the CPU's caches, as 30 layers are
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)

    def at(rows: int) -> Peers:
        lengths = torch.randint(32, 513, (rows,), generator=gen).tolist()
        width = -(-max(lengths) // BLOCK_SIZE)
        # Each call reads blocks of its own, as each of 30 layers does: the same blocks twice would come from L3.
        blocks = torch.randperm(num_blocks, generator=gen)[: num_blocks // (rows * width) * rows * width]
        metas = itertools.cycle([
            AttentionMetadata(False, torch.full((rows,), -1), tables.view(rows, width).int(),
                              context_lens=torch.tensor(lengths).int())
            for tables in blocks.split(rows * width)])
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
        kernel, reference = CpuAttention(), TorchAttention()
        return (lambda: kernel.decode(q, k_cache, v_cache, next(metas), HEAD_DIM**-0.5),
                lambda: reference.decode(q, k_cache, v_cache, next(metas), HEAD_DIM**-0.5))

    return at


def prefill_attention_peers(dtype: torch.dtype, prompt_tokens: int = PROMPT_TOKENS) -> Callable[[int], Peers]:
    gen = torch.Generator().manual_seed(0)
    cache = torch.empty(1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)  # nothing cached: never read

    def at(rows: int) -> Peers:
        q, k, v, meta = prefill_batch(rows, HEADS, KV_HEADS, HEAD_DIM, dtype, gen, prompt_tokens)
        kernel, reference = CpuAttention(), TorchAttention()
        return (lambda: kernel.prefill(q, k, v, cache, cache, meta, HEAD_DIM**-0.5),
                lambda: reference.prefill(q, k, v, cache, cache, meta, HEAD_DIM**-0.5))

    return at


def rms_norm_peers(dtype: torch.dtype) -> Callable[[int], Peers]:
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)

    def at(rows: int) -> Peers:
        x, residual = torch.randn(rows, HIDDEN).to(dtype), torch.randn(rows, HIDDEN).to(dtype)
        # Both peers make a new sum: the layer's torch code (``_norm``) after torch's add, the kernel on a copy.
        return (lambda: cpu_fused.rms_norm(x, residual.clone(), norm.weight, norm.eps),
                lambda: norm._norm(x + residual))

    return at


def silu_and_mul_peers(dtype: torch.dtype) -> Callable[[int], Peers]:
    def at(rows: int) -> Peers:
        x = torch.randn(rows, 2 * INTERMEDIATE).to(dtype)

        def torch_silu() -> torch.Tensor:
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up

        return lambda: cpu_fused.silu_and_mul(x), torch_silu

    return at


def rotary_peers(dtype: torch.dtype) -> Callable[[int], Peers]:
    rotary = RotaryEmbedding(HEAD_DIM, 2048, 100000.0, dtype)

    def at(rows: int) -> Peers:
        positions = torch.randint(0, 2048, (rows,))
        qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
        q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q, k = q.view(rows, HEADS, HEAD_DIM), k.view(rows, KV_HEADS, HEAD_DIM)

        def torch_rotary() -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

        return lambda: cpu_fused.rotary(positions, q, k, rotary.cos, rotary.sin), torch_rotary

    return at


KERNELS = {
    "linear": linear_peers,
    "decode_attention": decode_attention_peers,
    "prefill_attention": prefill_attention_peers,
    "rms_norm": rms_norm_peers,
    "silu_and_mul": silu_and_mul_peers,
    "rotary": rotary_peers,
}


def mean_ms(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64],
                        help="rows per call (decode: running sequences)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (W1: 2)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the model whose executor's choice to show: embedded name or local HF folder "
                             "(python -m bench.random_model FOLDER --arch smollm2-135m where the embedded one "
                             "is missing)")
    parser.add_argument("--dense-torch", action="store_true",
                        help="linear's torch peer: F.linear on the dense weights instead of oneDNN's copy")
    parser.add_argument("--small-pages", action="store_true",
                        help="linear: each packed weight in its own allocation (4 KiB pages) instead of one region "
                             "on huge pages")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                        help="prefill_attention: the longest prompt; --rows tokens are cut into prompts this long")
    parser.add_argument("--repeats", type=int, default=7, help="timings per peer and row count (median)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if cpu_kernels.kernel_library() is None:
        sys.exit("the C kernels could not be built here (no C compiler?): nothing to compare")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows_out, figures = [], {}
    for name in args.kernels:
        if name == "linear":
            peers_at = linear_peers(dtype, args.dense_torch, args.small_pages)
        elif name == "prefill_attention":
            peers_at = prefill_attention_peers(dtype, args.prompt_tokens)
        else:
            peers_at = KERNELS[name](dtype)
        for rows in progress(args.rows, desc=name):
            ours, theirs = peers_at(rows)
            calls = 3 if name == "linear" else 50
            ours(), theirs()
            ours_ms, theirs_ms = [], []
            for _ in range(args.repeats):
                ours_ms.append(mean_ms(ours, calls))
                theirs_ms.append(mean_ms(theirs, calls))
            a, b = statistics.median(ours_ms), statistics.median(theirs_ms)
            rows_out.append([name, rows, b, a, b / a])
            figures[f"{name}_{rows}_ms"], figures[f"{name}_{rows}_torch_ms"] = a, b
    print(f"{args.dtype}, {args.threads} threads, medians of {args.repeats}")
    print_table(["kernel", "rows", "torch ms", "C kernel ms", "ratio"], rows_out)
    choice = executor_choice(args.dtype, args.model)
    print(f"\nthe executor's choice for {args.model} ({choice.source}):")
    print_table(["family", *CLASSES], [[f, *(choice.table[f][c] for c in CLASSES)] for f in FAMILIES])
    write_json(args.json, {**figures, "choice": {f: dict(choice.table[f]) for f in FAMILIES}})


def executor_choice(dtype: str, model: str = DEFAULT_MODEL) -> KernelChoice:
    """The kernel table an executor of ``model`` starts with here (the threads are this process's)."""
    options = ExecutorOptions(dtype=dtype, threads=torch.get_num_threads(), kv_cache_memory=256 << 20)
    return ModelRunner(resolve_model(model), options).kernels


if __name__ == "__main__":
    main()
