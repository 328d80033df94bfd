"""Local attention kernels against materialised-softmax attention."""

import pytest
import torch

from megatron_lc.attention.kernel_selection import select_kernel
from megatron_lc.attention.kernels import KERNELS, attention, naive_attention

CPU_KERNELS = ["reference", "cpu_flash"]


def _inputs(T, H, Hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, d, generator=g, dtype=dtype) for h in (H, Hkv, Hkv)]


def _random_cu_seqlens(T, num_docs, seed):
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(T - 1, generator=g)[: num_docs - 1].add(1).tolist())
    return (0, *cuts, T)


def _compare(kernel_name, q, k, v, cu, tol):
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(qa, ka, va, cu, KERNELS[kernel_name])
    dout = torch.randn_like(out)
    out.backward(dout)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = naive_attention(qr, kr, vr, cu)
    ref_out.backward(dout.double())
    _, lse, _ = KERNELS[kernel_name].forward(q, k, v, cu)
    for got, want in [(out, ref_out), (lse, ref_lse), (qa.grad, qr.grad), (ka.grad, kr.grad), (va.grad, vr.grad)]:
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("T, H, Hkv, d, docs, seed", [
    (1, 2, 2, 8, 1, 0),
    (257, 4, 4, 16, 1, 1),
    (300, 8, 2, 16, 5, 2),
    (513, 6, 1, 32, 9, 3),
])
def test_kernel_matches_naive_attention_fp32(kernel, T, H, Hkv, d, docs, seed):
    q, k, v = _inputs(T, H, Hkv, d, torch.float32, seed)
    _compare(kernel, q, k, v, _random_cu_seqlens(T, docs, seed) if T > 1 else (0, 1), 2e-5)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_kernel_handles_single_token_and_empty_documents(kernel):
    q, k, v = _inputs(40, 4, 2, 8, torch.float32, 5)
    _compare(kernel, q, k, v, (0, 1, 1, 2, 39, 40), 2e-5)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_kernel_bf16_stays_close_to_fp64(kernel):
    q, k, v = _inputs(200, 4, 2, 16, torch.bfloat16, 6)
    _compare(kernel, q, k, v, (0, 120, 200), 5e-2)


def test_documents_do_not_attend_across_boundaries():
    q, k, v = _inputs(64, 2, 2, 8, torch.float32, 7)
    out_packed = attention(q, k, v, (0, 30, 64), KERNELS["cpu_flash"])
    out_second = attention(q[30:], k[30:], v[30:], (0, 34), KERNELS["cpu_flash"])
    torch.testing.assert_close(out_packed[30:], out_second)


def test_kernel_selection_on_cpu_and_clear_errors():
    assert select_kernel(torch.device("cpu")).name == "cpu_flash"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_kernel(torch.device("cpu"), "sdpa_flash")
    with pytest.raises(ValueError, match="warp"):
        select_kernel(torch.device("cpu"), "warp")
    with pytest.raises((ImportError, ValueError), match="flash"):
        select_kernel(torch.device("cpu"), "flash_attn")
