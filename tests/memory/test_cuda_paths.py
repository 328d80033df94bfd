"""The CUDA code paths: pinned pool, side-stream copies and events (skipped without CUDA)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_lc.memory import (
    OffloadScheduler,
    checkpoint_block,
    linear_cross_entropy,
    tiled_linear_cross_entropy,
    tiled_swiglu_mlp,
)
from tests.helpers import ResidualMLPBlock

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def test_offload_roundtrip_uses_pinned_reused_buffers():
    offload = OffloadScheduler(3, keep_last=1, accelerator=CUDA)
    tensors = [torch.randn(1024, 256, device=CUDA) for _ in range(2)]
    for _step in range(2):
        handles = [offload.offload(i, t * 1) for i, t in enumerate(tensors)]  # t * 1: freed early
        assert all(h.host_buffer.is_pinned() for h in handles)
        offload.prefetch(1)
        back = [offload.fetch(h) for h in reversed(handles)]
        assert all(b.device.type == "cuda" for b in back)
        assert torch.equal(back[0], tensors[1]) and torch.equal(back[1], tensors[0])
    assert offload.buffers_allocated == 2 and offload.host_bytes_in_use == 0


@pytest.mark.parametrize("use_offload", [False, True])
def test_checkpoint_stack_on_cuda_matches_plain(use_offload):
    torch.manual_seed(0)
    blocks = nn.ModuleList(ResidualMLPBlock(64, 256) for _ in range(4)).to(CUDA)
    x = torch.randn(2048, 64, device=CUDA, requires_grad=True)
    ref = x
    for block in blocks:
        ref = block(ref)
    ref.sum().backward()
    want = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    offload = OffloadScheduler(4, keep_last=1, accelerator=CUDA) if use_offload else None
    for _step in range(2):
        y = x
        for i, block in enumerate(blocks):
            y = checkpoint_block(block, y, offload=offload, layer_idx=i)
        y.sum().backward()
        got = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        torch.testing.assert_close(y, ref)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_tiled_functions_bf16_on_cuda_close_to_fp32():
    torch.manual_seed(0)
    x = torch.randn(4096, 128, device=CUDA, requires_grad=True)
    ws = [(torch.randn(s, device=CUDA) * 0.1).requires_grad_() for s in ((512, 128),) * 2]
    ws.append((torch.randn(128, 512, device=CUDA) * 0.1).requires_grad_())
    F.linear(F.silu(F.linear(x, ws[0])) * F.linear(x, ws[1]), ws[2]).sum().backward()
    low = [t.detach().bfloat16().requires_grad_() for t in (x, *ws)]
    tiled_swiglu_mlp(*low, 5).float().sum().backward()
    for lo, ref in zip(low, (x, *ws)):
        err = (lo.grad.float() - ref.grad).abs().max() / ref.grad.abs().max()
        assert err < 3e-2

    head = (torch.randn(5000, 128, device=CUDA) * 0.1).requires_grad_()
    labels = torch.randint(0, 5000, (4096,), device=CUDA)
    labels[::7] = -100
    h = x.detach().requires_grad_()
    loss, count = linear_cross_entropy(h, head, labels)
    (loss / count).backward()
    h_lo, head_lo = (t.detach().bfloat16().requires_grad_() for t in (h, head))
    tiled_loss, tiled_count = tiled_linear_cross_entropy(h_lo, head_lo, labels, 3)
    (tiled_loss / tiled_count).backward()
    assert int(tiled_count) == int(count)
    assert abs(float(tiled_loss.detach()) / float(loss.detach()) - 1) < 1e-2
    for lo, ref in ((h_lo, h), (head_lo, head)):
        assert (lo.grad.float() - ref.grad).abs().max() / ref.grad.abs().max() < 3e-2


def test_offload_arena_is_page_locked_at_its_exact_size_and_unlocked_on_close():
    offload = OffloadScheduler(4, keep_last=1, accelerator=CUDA)
    t = torch.randn(3, 1000, 7, device=CUDA)  # 84,000 bytes: torch's pinned pool would take 131,072 each
    handles = [offload.offload(i, t) for i in range(3)]
    assert all(h.host_buffer.is_pinned() for h in handles)
    assert offload.page_locked_bytes == 3 * t.numel() * 4
    assert all(torch.equal(offload.fetch(h), t) for h in reversed(handles))
    offload.close()
    assert offload.page_locked_bytes == 0
