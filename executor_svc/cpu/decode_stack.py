"""A CPU decode step's whole stack of decoder layers in C (``executor_svc/cpu/csrc/decode_stack.c``): one call, or four
a layer between projections that run in torch.

Called layer by layer, a decode step makes ~10 kernel calls a layer from Python, each with its wrapper's cost
(checks, views, output tensors, ctypes): a large share of a 1-sequence step of a small model. The C stack runs
the same kernels in the same order with the same roundings, so its tokens are the layers' own when their
kernel choice is C throughout (``tests/test_cpu_decode_stack.py``).

It serves a decode step where the kernel choice has C for decode attention and RMSNorm at its row count.
Where it has C for linear too, the whole stack is one call. Where it has torch (oneDNN's GEMMs, where they won the
machine's race), the four projections of each layer run in torch and the stack's C code between them in four
calls (RMSNorm, then rotary with the KV store and attention, RMSNorm, SiLU-and-mul), still faster than the
layers' path (W1 in-process with linear forced to torch from 9 rows, as a Xeon with AMX chose before the AMX
tile kernel). SiLU-and-mul and rotary run C inside the stack whatever the choice says for them: torch wins those
only at few rows, by the cost of the C call's wrapper, which the stack does not pay. It fits Llama and Qwen2
(q/k/v biases) on one rank with the ``cpu`` attention backend; Qwen3's q/k norms and biases after a row-parallel
projection take the layers' path.
A step with LoRA adapter rows takes the four-call form too, each projection through its module (its kernel choice,
then its adapters' update, ``executor_svc/lora``).
``--cpu-decode-stack off`` turns it off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from executor_svc.attention.base import AttentionMetadata
from executor_svc.attention.cpu_backend import CpuAttention
from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.cpu.fused import DTYPES
from executor_svc.cpu.kernels import contiguous_as
from executor_svc.runtime.distributed import tp_size

_P = ctypes.c_void_p
ERRORS = {
    1: (MemoryError, "the CPU decode stack's kernels could not allocate their scratch memory"),
    2: (IndexError, "a position is past the rotary table"),
    3: (IndexError, "a cache slot is past the KV cache"),
}


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "gate_up_bias", "down", "k_cache", "v_cache",
    )]


class _Shape(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size", "bf16", "threads")),
        ("num_slots", ctypes.c_int64), ("num_positions", ctypes.c_int64), ("eps", ctypes.c_float),
        ("scale", ctypes.c_float), ("cos", _P), ("sin", _P)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("max_blocks", ctypes.c_int), *((name, _P) for name in (
        "positions", "slots", "block_tables", "context_lens", "hidden", "residual", "scratch"))]


def _tensor(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``x`` as the contiguous tensor of ``dtype`` the kernel reads (None stays None)."""
    return None if x is None else x.detach().to(dtype).contiguous()


class CpuDecodeStack:
    """The C stack for one model's decoder layers, built once its weights are packed and its cache attached."""

    def __init__(self, model: nn.Module, backend: CpuAttention, dtype: torch.dtype) -> None:
        library = cpu_kernels.kernel_library()
        self._run, self._scratch_bytes = library.decode_stack, library.decode_stack_scratch_bytes
        self._attention, self._rms_norm, self._silu_and_mul = (
            library.decode_stack_attention, library.rms_norm, library.silu_and_mul)
        first = model.layers[0]
        attn, mlp = first.self_attn, first.mlp
        self.backend, self.dtype, self.first = backend, dtype, first
        self.packed = all(lin.packed_weight is not None for lin in _linears(model.layers))
        self.keep: list[torch.Tensor] = []  # what the layer structs point into, beyond the model's own tensors
        self.layers = (_Layer * len(model.layers))()
        # per layer, for steps whose projections run in torch: its struct, norms and projections
        self.torch_layers: list[tuple] = []
        self.adapted_layers: list[tuple] = []
        for layer, spec in zip(model.layers, self.layers, strict=True):
            a, m = layer.self_attn, layer.mlp
            tensors = [_tensor(layer.input_layernorm.weight, dtype), _tensor(layer.post_attention_layernorm.weight,
                       dtype), _tensor(a.qkv_proj.bias, dtype), _tensor(m.gate_up_proj.bias, dtype)]
            self.keep += [t for t in tensors if t is not None]
            spec.input_norm, spec.post_norm = tensors[0].data_ptr(), tensors[1].data_ptr()
            spec.qkv_bias = None if tensors[2] is None else tensors[2].data_ptr()
            spec.gate_up_bias = None if tensors[3] is None else tensors[3].data_ptr()
            if self.packed:
                spec.qkv, spec.o = a.qkv_proj.packed_weight.data.data_ptr(), a.o_proj.packed_weight.data.data_ptr()
                spec.gate_up = m.gate_up_proj.packed_weight.data.data_ptr()
                spec.down = m.down_proj.packed_weight.data.data_ptr()
            spec.k_cache, spec.v_cache = a.attn.k_cache.data_ptr(), a.attn.v_cache.data_ptr()
            self.torch_layers.append((
                ctypes.addressof(spec), tensors[0].data_ptr(), tensors[1].data_ptr(), a.qkv_proj.torch_matmul,
                a.qkv_proj.bias, a.o_proj.torch_matmul, m.gate_up_proj.torch_matmul, m.gate_up_proj.bias,
                m.down_proj.torch_matmul,
            ))
            # with LoRA adapters in the step: each projection whole (its kernel choice, then its adapters' update)
            self.adapted_layers.append((*self.torch_layers[-1][:3], _whole(a.qkv_proj), None, _whole(a.o_proj),
                                        _whole(m.gate_up_proj), None, _whole(m.down_proj)))
        cache = attn.attn.k_cache
        self.cos, self.sin = _tensor(attn.rotary.cos, dtype), _tensor(attn.rotary.sin, dtype)
        self.shape = _Shape(
            hidden=first.input_layernorm.weight.shape[0], heads=attn.num_heads, kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, intermediate=mlp.gate_up_proj.shard_sizes[0], block_size=cache.shape[1],
            bf16=int(dtype == torch.bfloat16), threads=torch.get_num_threads(),
            num_slots=cache.shape[0] * cache.shape[1], num_positions=self.cos.shape[0],
            eps=first.input_layernorm.eps, scale=attn.attn.scale, cos=self.cos.data_ptr(), sin=self.sin.data_ptr(),
        )
        self.step = _Step()
        self.scratch = torch.empty(0, dtype=torch.uint8)
        # the structs' addresses, taken once: ctypes converts a plain int fastest
        self._args = (ctypes.addressof(self.layers), len(self.layers), ctypes.addressof(self.shape),
                      ctypes.addressof(self.step))

    @staticmethod
    def fits(model: nn.Module, backend: object, dtype: torch.dtype) -> bool:
        """Whether this model's layers are ones the C stack runs exactly (module docstring)."""
        library = cpu_kernels.kernel_library()
        if library is None or not hasattr(library, "decode_stack") or not isinstance(backend, CpuAttention):
            return False
        layers = getattr(model, "layers", None)
        if dtype not in DTYPES or tp_size() != 1 or not layers:
            return False
        for lin in _linears(layers):  # the C code reads each projection's output as ``dtype``
            if lin.weight.dtype != dtype or lin.packed_weight is not None and lin.packed_weight.dtype != dtype:
                return False
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            if a.q_norm is not None or a.o_proj.bias is not None or m.down_proj.bias is not None:
                return False
            cache = a.attn.k_cache
            if cache.dim() != 4 or cache.dtype != dtype or not cache.is_cpu or not cache.is_contiguous():
                return False
        return True

    def applies(self, hidden: torch.Tensor, meta: AttentionMetadata, adapted: bool = False) -> bool:
        """A decode step on the CPU, at a row count where decode attention and RMSNorm run C; linear may run
        either way, C only where the weights have packed copies (``adapted``: the step has LoRA adapter rows, and
        each projection runs whole in Python, as its module does)."""
        rows = hidden.shape[0]
        return (not meta.is_prefill and hidden.is_cpu and hidden.dtype == self.dtype and rows > 0
                and (self.packed or adapted or not self._c_linear(rows))
                and self.backend.kernels.use_c("decode_attention", rows)
                and self.first.input_layernorm.kernels.use_c("rms_norm", rows))

    def _c_linear(self, rows: int) -> bool:
        return self.first.self_attn.qkv_proj.kernels.use_c("linear", rows)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, adapted: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual) for a step ``applies`` took; ``hidden`` (the embeddings,
        [rows, hidden]) may be overwritten."""
        rows = hidden.shape[0]
        hidden = hidden if hidden.is_contiguous() else hidden.contiguous()
        residual = torch.empty_like(hidden)
        scratch_bytes = self._scratch_bytes(self._args[2], rows)
        if self.scratch.numel() < scratch_bytes:
            self.scratch = torch.empty(scratch_bytes, dtype=torch.uint8)
        positions, slots = contiguous_as(positions, torch.int64), contiguous_as(meta.slot_mapping, torch.int64)
        tables, lengths = contiguous_as(meta.block_tables, torch.int32), contiguous_as(meta.context_lens, torch.int32)
        step = self.step
        step.rows, step.max_blocks = rows, tables.shape[1]
        step.positions, step.slots = positions.data_ptr(), slots.data_ptr()
        step.block_tables, step.context_lens = tables.data_ptr(), lengths.data_ptr()
        step.hidden, step.residual, step.scratch = hidden.data_ptr(), residual.data_ptr(), self.scratch.data_ptr()
        self.shape.threads = torch.get_num_threads()
        if adapted:
            return self._run_torch_linears(hidden, residual, self.adapted_layers)
        if not self._c_linear(rows):
            return self._run_torch_linears(hidden, residual)
        _check(self._run(*self._args))
        return hidden, residual

    def _run_torch_linears(self, hidden: torch.Tensor, residual: torch.Tensor, layers: list[tuple] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stack with each projection through Python (``torch_layers``, the default: ``LinearBase.torch_matmul``;
        ``adapted_layers``: the whole module, with its LoRA update), the rest in C between."""
        rows, shape, step = hidden.shape[0], self._args[2], self._args[3]
        size, eps, bf16, threads = self.shape.hidden, self.shape.eps, self.shape.bf16, self.shape.threads
        inter = self.shape.intermediate
        normed, act = torch.empty_like(hidden), torch.empty(rows, inter, dtype=self.dtype)
        attn = torch.empty(rows, self.shape.heads * self.shape.head_dim, dtype=self.dtype)
        normed_p, attn_p, act_p, residual_p = normed.data_ptr(), attn.data_ptr(), act.data_ptr(), residual.data_ptr()
        residual.copy_(hidden)  # the embeddings are the residual; the first norm adds nothing
        x, added = hidden, None
        # each projection's output is held in a name while C reads it: a temporary would be freed first
        for spec, input_norm, post_norm, qkv, qkv_bias, o, gate_up, gate_up_bias, down in layers or self.torch_layers:
            self._rms_norm(x.data_ptr(), size, added, input_norm, normed_p, rows, size, eps, bf16, threads)
            added = residual_p
            y = qkv(normed, qkv_bias)
            _check(self._attention(spec, shape, step, y.data_ptr(), attn_p))
            y = o(attn, None)
            self._rms_norm(y.data_ptr(), size, residual_p, post_norm, normed_p, rows, size, eps, bf16, threads)
            y = gate_up(normed, gate_up_bias)
            self._silu_and_mul(y.data_ptr(), act_p, rows, inter, bf16, threads)
            x = down(act, None)
        return x, residual


def _whole(linear: nn.Module) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """A projection module as ``torch_matmul``'s signature: its own forward adds its bias."""
    return lambda x, bias: linear(x)


def _linears(layers: nn.ModuleList) -> list[nn.Module]:
    return [lin for layer in layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _check(failed: int) -> None:
    if failed:
        error, message = ERRORS[failed]
        raise error(message)


def attach(model: nn.Module, backend: object, dtype: torch.dtype) -> bool:
    """Give ``model``'s decoder (a ``LlamaModel``) the C stack where it fits; whether it did."""
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "cpu_stack") or not CpuDecodeStack.fits(decoder, backend, dtype):
        return False
    decoder.cpu_stack = CpuDecodeStack(decoder, backend, dtype)
    return True
