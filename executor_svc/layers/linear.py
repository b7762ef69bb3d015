"""Tensor-parallel linear layers with packed shards (q/k/v into qkv, gate/up into gate_up).

A column-parallel layer splits its output features across ranks and needs no
communication; a row-parallel layer splits its input features and sums the
partial outputs with an all-reduce. ``load`` takes a full checkpoint tensor and
copies this rank's slice into the right place of the packed parameter.

On the CPU, ``prepack_for_cpu`` packs each float32 or bfloat16 weight once after loading
into the layout of our C kernel (``executor_svc/cpu/csrc/linear.c``), and that copy replaces the
dense one unless the kernel choice asks for torch at some row count. Decode multiplies a few
rows (one per sequence) by each weight, where torch's GEMMs run far below the machine's peak;
the kernel streams each weight once per call with the arithmetic overlapping the stream: faster than
torch at decode's row counts on an AVX-512 BF16 EPYC, than torch's bfloat16 on an AVX2-only Zen 3, and
(through AMX tiles, ``linear_amx.c``) than oneDNN's AMX GEMMs on a Xeon that has them; the choice is still
measured per machine. A model's packed weights lie in one region on huge pages, in the order a step reads them.
Without a C compiler or AVX2, and where torch is chosen, weights go to oneDNN in its own layout, faster
than ``F.linear`` at decode's sizes (float32, and bfloat16 where the CPU has it natively).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.cpu.choice import ALL_C, KernelChoice
from executor_svc.cpu.cpuinfo import cpu_flags
from executor_svc.cpu.huge_pages import slices_on_huge_pages
from executor_svc.runtime.distributed import all_reduce, divide, tp_rank, tp_size

if TYPE_CHECKING:
    from executor_svc.lora.layers import LoraWeights

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The row count oneDNN lays a reordered bfloat16 weight out for (``onednn_copy``): a full decode batch. Between 1
# and 512 it made no difference beyond noise on the 2-core EPYC.
REORDER_ROWS = 64


@dataclass
class PackedWeight:
    """A weight [n, k] in the C kernel's layout; ``data`` is a 64-byte aligned view of bytes."""

    data: torch.Tensor
    n: int
    k: int
    dtype: torch.dtype

    @staticmethod
    def packed_bytes(weight: torch.Tensor) -> int:
        if weight.dtype not in PACKED_DTYPES or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)} on {weight.device}")
        n, k = weight.shape
        return cpu_kernels.kernel_library().linear_packed_bytes(n, k, weight.dtype == torch.bfloat16)

    @classmethod
    def pack(cls, weight: torch.Tensor, into: torch.Tensor | None = None) -> PackedWeight:
        """``into``: the 64-byte aligned bytes to pack into (``packed_bytes`` of them), else new ones."""
        size = cls.packed_bytes(weight)
        if into is None:
            buffer = torch.empty(size + 63, dtype=torch.uint8)
            start = -buffer.data_ptr() % 64  # the kernel's aligned loads
            into = buffer[start : start + size]
        elif into.numel() != size or into.data_ptr() % 64:
            raise ValueError(f"packing needs {size} bytes on a 64-byte boundary")
        weight, bf16 = weight.contiguous(), weight.dtype == torch.bfloat16
        n, k = weight.shape
        cpu_kernels.kernel_library().linear_pack(weight.data_ptr(), into.data_ptr(), n, k, bf16)
        return cls(into, n, k, weight.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Each reshape, cast or view costs a dispatch even when it changes nothing, and a decode step makes ~120
        # of these calls: a 2-D input of the weight's dtype takes none.
        rows = x if x.dim() == 2 and x.shape[1] == self.k else x.reshape(-1, self.k)
        if rows.dtype != self.dtype:
            rows = rows.to(self.dtype)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.n, dtype=self.dtype)
        if bias is not None and (bias.dtype != self.dtype or not bias.is_contiguous()):
            bias = bias.to(self.dtype).contiguous()
        failed = cpu_kernels.kernel_library().linear_forward(
            rows.data_ptr(), rows.stride(0), self.data.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), rows.shape[0], self.n, self.k, self.dtype == torch.bfloat16, torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the CPU linear kernel could not allocate its copy of the input")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.n)


class LinearBase(nn.Module):
    """A layer computing ``x @ weight.T``: through the C kernel's packed copy of the weight where the executor's
    kernel choice (``executor_svc/cpu/choice.py``) says it is the faster at this many rows, else through torch."""

    weight: nn.Parameter
    packed_weight: PackedWeight | None = None
    onednn_weight: torch.Tensor | None = None
    kernels: KernelChoice = ALL_C
    # The adapters' factors for this projection (``executor_svc/lora``); None: no adapter serving.
    lora: LoraWeights | None = None

    def lora_active(self) -> bool:
        """Whether the running step has adapter rows, so this projection adds their low-rank update."""
        return self.lora is not None and self.lora.step.batch is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, rows: int | None = None) -> torch.Tensor:
        """``rows``: the row count the kernel choice goes by (default: ``x``'s), a whole step's for a chunk of it."""
        packed = self.packed_weight
        if packed is not None:
            if rows is None:
                rows = x.shape[0] if x.dim() == 2 else x.numel() // packed.k
            if self.kernels.use_c("linear", rows):
                return packed.linear(x, bias)
        return self.torch_matmul(x, bias)

    def torch_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, bias, "none", [], "")
        if self.weight.dtype == torch.bfloat16 and self.weight.device.type == "cpu" and not native_bfloat16():
            # Products of bfloat16 are exact in float32, summed there and rounded once, as torch's bfloat16 GEMM
            # does. The weight's widening costs little beside a prefill GEMM, which then runs at MKL's float32
            # speed: faster than the C kernel at prefill sizes, and far faster than torch's own bfloat16 GEMM.
            bias = None if bias is None else bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(torch.bfloat16)
        return F.linear(x, self.weight, bias)


@functools.cache
def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16, AMX; assumed where /proc/cpuinfo names no x86
    flags). Without, torch's bfloat16 GEMM runs far below its float32 speed."""
    return not cpu_flags() or cpu_kernels.names_bfloat16_instructions()


def packing_helps() -> bool:
    """Whether the C kernel library is here and has a vectorised GEMM, AVX-512 or AVX2 (its portable loops lose to
    torch's)."""
    library = cpu_kernels.kernel_library()
    return library is not None and library.linear_is_vectorised() == 1


def cpu_linear_layers(model: nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase) and m.weight.device.type == "cpu"]


def prepack_for_cpu(
    model: nn.Module, c_kernel: bool | None = None, torch_copy: bool | None = None,
    layers: list[LinearBase] | None = None,
) -> None:
    """Give every float32 or bfloat16 CPU linear layer of ``model`` (or just ``layers``) the weights its matmuls
    will read: a packed copy for the C kernel (``c_kernel``; default: where it can help, see ``packing_helps``)
    and, for torch (``torch_copy``; default: where there is no packed copy), a oneDNN copy (``onednn_copy``),
    or the dense weight itself.

    A dense weight no path reads is emptied unless another module shares it (a tied LM head shares the
    embedding's), so packing costs no memory beyond such shared weights and the copies asked for.
    """
    layers = cpu_linear_layers(model) if layers is None else layers
    if not layers:
        return  # a model on CUDA: the CPU kernels are not built for it
    c_kernel = packing_helps() if c_kernel is None else c_kernel and packing_helps()
    torch_copy = not c_kernel if torch_copy is None else torch_copy or not c_kernel
    holders = Counter(id(m.weight) for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor))
    layers = [module for module in layers if module.weight.dtype in PACKED_DTYPES]
    if c_kernel:  # all in one region on huge pages, in the order a step reads them
        regions = slices_on_huge_pages([PackedWeight.packed_bytes(module.weight) for module in layers])
    for i, module in enumerate(layers):
        weight = module.weight
        if c_kernel:
            module.packed_weight = PackedWeight.pack(weight.detach(), regions[i])
        if torch_copy:
            module.onednn_weight = onednn_copy(weight.detach())
        dense_read = torch_copy and module.onednn_weight is None
        copied = module.packed_weight is not None or module.onednn_weight is not None
        if holders[id(weight)] == 1 and copied and not dense_read:
            weight.data = weight.data.new_empty(0)


def onednn_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's own layout for ``torch.ops.mkldnn._linear_pointwise``, or None where torch reads the
    dense one. Given a dense bfloat16 weight, oneDNN reorders it into its blocked layout on every call (a second
    pass over every weight per decode step); reordered once, the step's GEMMs beat ``F.linear``'s at decode's row
    counts. Without native bfloat16 (``native_bfloat16``) the dense weight stays, for ``torch_matmul``'s float32
    path."""
    if not torch.backends.mkldnn.is_available() or weight.device.type != "cpu":
        return None
    if weight.dtype == torch.float32:
        return weight.to_mkldnn()
    if weight.dtype == torch.bfloat16 and native_bfloat16():
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), REORDER_ROWS)
    return None


def drop_unused_copies(model: nn.Module, choice: KernelChoice) -> None:
    """After the kernel choice: free the copies of each weight that no shape class reads."""
    c, torch_way = choice.uses("linear", "c"), choice.uses("linear", "torch")
    holders = Counter(id(m.weight) for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor))
    for module in cpu_linear_layers(model):
        if module.packed_weight is None:
            continue
        if not torch_way:
            module.onednn_weight = None
            if holders[id(module.weight)] == 1:
                module.weight.data = module.weight.data.new_empty(0)
        elif not c:
            module.packed_weight = None


class ColumnParallelLinear(LinearBase):
    """``output_sizes`` are the full sizes of the packed shards, in order (one entry when unpacked)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.shard_sizes = [divide(size, tp_size()) for size in output_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.shard_sizes), input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(self.shard_sizes)), requires_grad=False) if bias else None

    def load(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        size = self.shard_sizes[shard]
        target = getattr(self, param_name).data.narrow(0, sum(self.shard_sizes[:shard]), size)
        target.copy_(loaded.narrow(0, tp_rank() * size, size))

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        y = self.matmul(x, self.bias, rows)
        if self.lora is not None and self.lora.step.batch is not None:
            self.lora.add(x, y)
        return y


class QKVParallelLinear(ColumnParallelLinear):
    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, divide(input_size, tp_size())), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def load(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if param_name == "bias":
            self.bias.data.copy_(loaded)
            return
        size = self.weight.shape[1]
        self.weight.data.copy_(loaded.narrow(1, tp_rank() * size, size))

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        y = self.matmul(x, None, rows)
        if self.lora is not None and self.lora.step.batch is not None:
            self.lora.add(x, y)  # a partial sum under tensor parallelism, like y's
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias
