"""The C elementwise kernels (``executor_svc/cpu/fused.py``) against the torch code they replace.

The kernels round where torch rounds, so they differ from it only where a float32 sum is taken in another
order or glibc's expf differs from torch's in the last bit: float32 results by a few units in the last
place, bfloat16 ones at a rare rounding edge by one bfloat16 step; the rotary embedding not at all. The
layers fall back to torch for tensors the kernels do not take.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention.cpu_backend import CpuAttention
from executor_svc.attention.torch_backend import TorchAttention
from executor_svc.cpu import fused as cpu_fused
from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.layers.activation import SiluAndMul
from executor_svc.layers.norm import RMSNorm
from executor_svc.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel_library() is None, reason="no C compiler here to build the CPU kernels"
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def seeded() -> None:
    """The same random inputs every run: the bfloat16 checks count rare rounding-edge mismatches."""
    torch.manual_seed(0)


@pytest.fixture
def torch_only(monkeypatch: pytest.MonkeyPatch):
    """Runs the layers' torch code: the reference."""

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(cpu_kernels, "kernel_library", lambda: None)
            return fn(*args)

    return run


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    if out.dtype == torch.bfloat16:
        assert (out != expected).float().mean() < 1e-3
        torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=2**-6)
    else:
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_the_residual(dtype: torch.dtype, rows: int, torch_only) -> None:
    """One row runs on the calling thread, 300 rows of 576 on two."""
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, dtype=dtype)
    x, residual = torch.randn(rows, 576, dtype=dtype) * 3, torch.randn(rows, 576, dtype=dtype)
    assert cpu_fused.rms_norm(x, None, norm.weight, norm.eps) is not None
    assert_matches(norm(x), torch_only(norm, x))

    ours_residual, their_residual = residual.clone(), residual.clone()
    out, summed = norm(x, ours_residual)
    expected, expected_sum = torch_only(norm, x, their_residual)
    assert summed is ours_residual and torch.equal(summed, expected_sum) and torch.equal(summed, x + residual)
    assert_matches(out, expected)


def test_rms_norm_reads_strided_rows_and_leaves_other_layouts_to_torch() -> None:
    weight = torch.randn(64)
    wide = torch.randn(5, 100)
    strided = wide[:, 10:74]
    assert torch.equal(cpu_fused.rms_norm(strided, None, weight, 1e-6), cpu_fused.rms_norm(strided.contiguous(), None,
                                                                                             weight, 1e-6))
    heads = torch.randn(5, 3, 64)  # Qwen3's q/k norm over [tokens, heads, head_dim]: torch's code
    assert cpu_fused.rms_norm(heads, None, weight, 1e-6) is None
    assert cpu_fused.rms_norm(torch.randn(5, 64).half(), None, weight.half(), 1e-6) is None
    assert cpu_fused.rms_norm(torch.randn(5, 64), None, weight.bfloat16(), 1e-6) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_and_mul(dtype: torch.dtype, rows: int, torch_only) -> None:
    x = torch.randn(rows, 2 * 1536, dtype=dtype) * 4
    x[0, :4] = torch.tensor([0.0, -90.0, 90.0, float("inf")])  # exp over- and underflow, silu(inf) = inf
    x[0, 1536 : 1536 + 4] = 1.0
    assert cpu_fused.silu_and_mul(x) is not None
    out, expected = SiluAndMul()(x), torch_only(SiluAndMul(), x)
    assert out.shape == (rows, 1536)
    assert_matches(out, expected)
    assert out[0, :4].tolist() == [0.0, 0.0, 90.0, float("inf")]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_the_packed_qkv_matches_torch_exactly(dtype: torch.dtype, torch_only) -> None:
    rotary = RotaryEmbedding(64, 4096, 100000.0, dtype)
    qkv = torch.randn(200, 9 * 64 + 2 * 3 * 64, dtype=dtype)
    positions = torch.randint(0, 4096, (200,))

    def views(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = packed.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
        return q.view(-1, 9, 64), k.view(-1, 3, 64)

    expected_q, expected_k = torch_only(rotary, positions, *views(qkv.clone()))
    packed = qkv.clone()
    q, k = rotary(positions, *views(packed))
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(packed[:, -192:], qkv[:, -192:]), "v is not touched"
    assert q.data_ptr() == packed.data_ptr(), "rotated in place"


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_torch_and_skips_padded_rows(dtype: torch.dtype) -> None:
    kv = torch.randn(6, 2 * 3 * 8, dtype=dtype)
    k, v = (t.view(-1, 3, 8) for t in kv.chunk(2, dim=-1))
    slots = torch.tensor([5, -1, 0, 17, 9, -1])
    caches = [torch.zeros(5, 4, 3, 8, dtype=dtype) for _ in range(4)]
    backend, calls = CpuAttention(), []
    kernel = backend._store
    backend._store = lambda *args: calls.append(args) or kernel(*args)
    backend.store_kv(k, v, caches[0], caches[1], slots)
    assert len(calls) == 1, "the C copy ran"
    TorchAttention().store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].flatten(0, 1)[5].equal(k[0]) and caches[1].flatten(0, 1)[17].equal(v[3])


def test_store_kv_refuses_a_slot_past_the_cache_and_writes_nothing() -> None:
    k = v = torch.randn(2, 3, 8)
    cache = torch.zeros(5, 4, 3, 8)
    with pytest.raises(IndexError, match="past the cache"):
        CpuAttention().store_kv(k, v, cache, cache.clone(), torch.tensor([0, 20]))
    assert not cache.any()


def test_rotary_refuses_a_position_past_its_table_and_leaves_odd_shapes_to_torch() -> None:
    rotary = RotaryEmbedding(8, 16, 10000.0, torch.float32)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    before = q.clone()
    with pytest.raises(IndexError, match="past the rotary table"):
        cpu_fused.rotary(torch.tensor([3, 16]), q, k, rotary.cos, rotary.sin)
    assert torch.equal(q, before)
    assert cpu_fused.rotary(torch.tensor([1, 2]), q.view(2, 16), k, rotary.cos, rotary.sin) is None
    assert cpu_fused.rotary(torch.tensor([1, 2, 3]), q, k, rotary.cos, rotary.sin) is None


def test_tensors_off_the_cpu_never_build_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # A model on a GPU keeps the default choice (C kernels) for its layers: asking whether they apply must not compile
    # the CPU library in the GPU process.
    def build() -> None:
        raise AssertionError("the CPU kernels were built for a tensor that is not on the CPU")

    monkeypatch.setattr(cpu_kernels, "kernel_library", build)
    assert not cpu_fused._usable(torch.empty(4, 8, device="meta"))
