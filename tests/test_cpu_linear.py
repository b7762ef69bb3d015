"""The C linear kernel (``executor_svc/cpu/csrc/linear.c``) through ``PackedWeight``, and how layers get packed.

float32 results may differ from torch's only by the order of the sums (no further from the float64 product
than torch's own); bfloat16 ones are rounded once from float32 sums, as torch's are, so they match
``F.linear`` except at a rare rounding edge.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.layers import linear
from executor_svc.layers.linear import ColumnParallelLinear, PackedWeight, RowParallelLinear, prepack_for_cpu
from tests.attention_helpers import cpu_kernel_builds

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel_library() is None, reason="no C compiler here to build the CPU kernels"
)

# SmolLM2's qkv and down projections, and shapes with every tail: n not a multiple of 16, odd and tiny k.
SHAPES = [(960, 576), (576, 1536), (17, 33), (1, 3), (50, 2), (33, 577)]
ROWS = [1, 7, 17, 64, 300]


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=cpu_kernel_builds(without_amx=True))
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    """Each kernel build to test (this machine's, its AVX2 variant on an AVX-512 machine, its AVX-512 one without AMX
    on a machine with AMX) as the library."""
    monkeypatch.setattr(cpu_kernels, "kernel_library", lambda *flags: request.param)
    return request.param


def check(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    theirs = F.linear(x, weight, bias)
    assert out.dtype == x.dtype and out.shape == theirs.shape
    if x.dtype == torch.float32:
        assert (out.double() - exact).abs().max() <= 2 * (theirs.double() - exact).abs().max() + 1e-5
    else:
        assert (out != theirs).float().mean() <= 2e-3
        torch.testing.assert_close(out.float(), theirs.float(), atol=1e-2, rtol=2**-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_matches_torch(dtype: torch.dtype, n: int, k: int, rows: int, build: ctypes.CDLL) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    packed = PackedWeight.pack(weight)
    check(packed.linear(x, None), x, weight, None)
    check(packed.linear(x, bias), x, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_and_batched_inputs(dtype: torch.dtype, build: ctypes.CDLL) -> None:
    """Rows of a wider tensor (an odd offset and stride), and [batch, tokens, k] inputs."""
    weight = torch.randn(48, 65).to(dtype)
    wide = torch.randn(9, 131).to(dtype)
    x = wide[:, 1:66]
    packed = PackedWeight.pack(weight)
    check(packed.linear(x, None), x, weight, None)
    batched = torch.randn(2, 5, 65).to(dtype)
    check(packed.linear(batched, None), batched, weight, None)


def test_layers_are_packed_and_shared_weights_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing replaces a layer's dense weight unless another module holds it too; where the kernel cannot
    help (no library, or no AVX-512) float32 goes to oneDNN, and bfloat16 too where the CPU has it natively (else it
    stays dense), with the same outputs."""
    monkeypatch.setattr(linear, "packing_helps", lambda: True)
    model = torch.nn.Sequential(ColumnParallelLinear(64, [32, 32], bias=True), RowParallelLinear(64, 64))
    for module in model:
        torch.nn.init.normal_(module.weight)
    torch.nn.init.normal_(model[0].bias)
    shared = torch.nn.Module()
    shared.weight = model[1].weight
    model.append(torch.nn.ModuleDict({"tied": shared}))
    x = torch.randn(5, 64)
    expected = model[1](model[0](x))
    prepack_for_cpu(model)
    assert model[0].packed_weight is not None and model[0].weight.numel() == 0
    assert model[1].packed_weight is not None and model[1].weight.numel() == 64 * 64, "shared: kept"
    torch.testing.assert_close(model[1](model[0](x)), expected, atol=1e-4, rtol=1e-4)

    monkeypatch.setattr(linear, "packing_helps", lambda: False)
    for native in (True, False):
        monkeypatch.setattr(linear, "native_bfloat16", lambda native=native: native)
        fallback = [RowParallelLinear(64, 64), RowParallelLinear(64, 64).bfloat16()]
        for layer in fallback:
            torch.nn.init.normal_(layer.weight)
        expected = [fallback[0](x), fallback[1](x.bfloat16())]
        prepack_for_cpu(torch.nn.Sequential(*fallback))
        onednn = torch.backends.mkldnn.is_available()
        assert (fallback[0].onednn_weight is not None) == onednn
        assert fallback[1].packed_weight is None and (fallback[1].onednn_weight is not None) == (onednn and native)
        assert (fallback[1].weight.numel() == 0) == (onednn and native), "dense only where torch reads it"
        torch.testing.assert_close(fallback[0](x), expected[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fallback[1](x.bfloat16()), expected[1], atol=0.1, rtol=0.02)


@pytest.mark.parametrize("native", [True, False])
def test_torchs_bfloat16_path_sums_in_float32_where_the_cpu_has_no_bfloat16(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """Without AVX512_BF16 or AMX torch's own bfloat16 GEMM is 5x slower than its float32 one, so the layer widens to
    float32 and rounds once; with them, it keeps torch's bfloat16 GEMM."""
    monkeypatch.setattr(linear, "native_bfloat16", lambda: native)
    layer = ColumnParallelLinear(96, [40], bias=True).bfloat16()
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(300, 96).bfloat16()
    if native:
        expected = F.linear(x, layer.weight, layer.bias)
    else:
        expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()).bfloat16()
    out = layer.torch_matmul(x, layer.bias)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_packing_refuses_what_the_kernel_cannot_read() -> None:
    with pytest.raises(ValueError, match="float16"):
        PackedWeight.pack(torch.randn(4, 4).half())
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4\)"):
        PackedWeight.pack(torch.randn(2, 3, 4))


def test_a_transposed_weight_packs_as_its_values() -> None:
    weight = torch.randn(33, 20).t()  # not contiguous: packed from a contiguous copy
    x = torch.randn(3, 33)
    check(PackedWeight.pack(weight).linear(x, None), x, weight, None)


def test_amx_tiles_and_onednn_take_turns_on_the_same_threads() -> None:
    """On a CPU with AMX, the C kernel's tile GEMM and oneDNN's run on the same OpenMP threads, whose tile
    configuration each sets: alternating them at row counts that configure the tiles differently, each still gives
    its own results."""
    if not cpu_kernels.kernel_library().linear_amx_ready():
        pytest.skip("this CPU or build has no AMX tiles")
    weight = (torch.randn(960, 576) / 24).bfloat16()
    packed, onednn = PackedWeight.pack(weight), linear.onednn_copy(weight)
    if onednn is None:
        pytest.skip("torch has no oneDNN here")
    for rows in (1, 17, 64, 5, 33):
        x = torch.randn(rows, 576).bfloat16()
        ours = packed.linear(x, None)
        theirs = torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
        check(ours, x, weight, None)
        check(theirs, x, weight, None)
        assert torch.equal(packed.linear(x, None), ours)
