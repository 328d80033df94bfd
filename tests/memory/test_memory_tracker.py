"""Measured memory (MemTracker): tiled loss and checkpointing + offload hold what they claim.

On CPU the accelerator and the host are the same device, so the tracker's cpu bytes
include the offloaded ones; the accelerator-resident share is the tracked total minus
the host bytes the offload scheduler reports (its whole pool, in use or not).
"""

import contextlib

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from megatron_lc.memory import (
    OffloadScheduler,
    checkpoint_block,
    linear_cross_entropy,
    tiled_linear_cross_entropy,
)
from tests.helpers import ResidualMLPBlock

MIB = 1 << 20


def _total(snapshot) -> int:
    """Bytes over all categories on the (single, cpu) device of a tracker snapshot."""
    (device_snapshot,) = snapshot.values()
    return device_snapshot["Total"]


def _loss_step_peak(loss_fn, hidden, weight, labels) -> int:
    """Peak tracked bytes of one loss forward + backward, above the inputs."""
    tracker = MemTracker()
    tracker.track_external(hidden, weight, labels)
    with tracker:
        before = _total(tracker.get_tracker_snapshot("current"))
        loss_sum, num_valid = loss_fn(hidden, weight, labels)
        (loss_sum / num_valid).backward()
    hidden.grad = weight.grad = None
    return _total(tracker.get_tracker_snapshot("peak")) - before


def _tiled_loss(hidden, weight, labels):
    return tiled_linear_cross_entropy(hidden, weight, labels, 16)


@pytest.mark.parametrize(
    "fake, n, vocab, hidden_size", [(True, 8192, 32000, 64), (False, 2048, 8000, 64)]
)
def test_tiled_loss_peak_is_far_below_untiled(fake, n, vocab, hidden_size):
    # Fake tensors measure the full size without allocating it (and show the code traces).
    with FakeTensorMode() if fake else contextlib.nullcontext():
        hidden = torch.randn(n, hidden_size).requires_grad_()
        weight = torch.randn(vocab, hidden_size).requires_grad_()
        labels = torch.randint(0, vocab, (n,))
        untiled = _loss_step_peak(linear_cross_entropy, hidden, weight, labels)
        tiled = _loss_step_peak(_tiled_loss, hidden, weight, labels)
    logits_mib = n * vocab * 4 / MIB
    print(
        f"\nloss N={n} V={vocab} h={hidden_size} ({'fake' if fake else 'real'}): full fp32 logits "
        f"{logits_mib:.1f} MiB; peak untiled {untiled / MIB:.1f} MiB, "
        f"tiled(16) {tiled / MIB:.1f} MiB, ratio {untiled / tiled:.1f}x"
    )
    assert untiled >= 2 * n * vocab * 4  # logits and their gradient at least
    assert untiled / tiled > 10


def _activation_bytes(blocks, x, mode, offload=None):
    """(accelerator bytes kept after forward, accelerator peak over the step, host bytes)."""
    tracker = MemTracker()
    tracker.track_external(blocks, x)
    with tracker:
        before = _total(tracker.get_tracker_snapshot("current"))
        y = x
        for i, block in enumerate(blocks):
            y = (
                block(y)
                if mode == "plain"
                else checkpoint_block(block, y, offload=offload, layer_idx=i)
            )
        host = offload.host_bytes_reserved if offload else 0
        kept = _total(tracker.get_tracker_snapshot("current")) - before - host
        y.sum().backward()
    blocks.zero_grad(set_to_none=True)
    peak = _total(tracker.get_tracker_snapshot("peak")) - before - host
    return kept, peak, host


def test_checkpoint_and_offload_keep_less_on_the_accelerator():
    hidden, ffn, tokens, layers = 64, 256, 4096, 8
    blocks = nn.ModuleList(ResidualMLPBlock(hidden, ffn) for _ in range(layers))
    x = torch.randn(tokens, hidden, requires_grad=True)
    block_input = x.numel() * x.element_size()
    offload = OffloadScheduler(layers, keep_last=1, accelerator="cpu")

    rows = {
        "plain": _activation_bytes(blocks, x, "plain"),
        "checkpoint": _activation_bytes(blocks, x, "checkpoint"),
        "checkpoint+offload": _activation_bytes(blocks, x, "checkpoint", offload),
    }
    print(f"\n{layers} blocks, block input {block_input / MIB:.2f} MiB (kept = after forward)")
    for name, (kept, peak, host) in rows.items():
        mib = [value / MIB for value in (kept, peak, host)]
        print(f"{name:>20}: kept {mib[0]:6.2f} MiB, peak {mib[1]:6.2f} MiB, host {mib[2]:5.2f} MiB")

    plain_kept, checkpoint_kept, offload_kept = (rows[k][0] for k in rows)
    assert checkpoint_kept < plain_kept / 4
    # Kept on the accelerator with offload: the last layer's input and the output.
    assert offload_kept <= 2 * block_input < checkpoint_kept
    assert rows["checkpoint+offload"][2] == (layers - 1) * block_input
    # Peaks: offload still holds one prefetched input more than the kept ones.
    assert rows["checkpoint+offload"][1] < rows["checkpoint"][1] < rows["plain"][1] / 2


def test_fake_tensors_with_meta_host_count_host_bytes_apart():
    """The planner's setting: fake tensors, accelerator cpu, host meta; the tracker splits them."""
    layers, tokens, hidden = 4, 4096, 64
    with FakeTensorMode():
        blocks = nn.ModuleList(ResidualMLPBlock(hidden, 4 * hidden) for _ in range(layers))
        x = torch.randn(tokens, hidden, requires_grad=True)
        head = torch.randn(1000, hidden, requires_grad=True)
        labels = torch.randint(0, 1000, (tokens,))
        offload = OffloadScheduler(layers, keep_last=1, accelerator="cpu", host="meta")
        tracker = MemTracker()
        tracker.track_external(blocks, x, head)
        with tracker:
            y = x
            for i, block in enumerate(blocks):
                y = checkpoint_block(block, y, offload=offload, layer_idx=i)
            after_forward = tracker.get_tracker_snapshot("current")
            loss, count = tiled_linear_cross_entropy(y, head, labels, 4)
            (loss / count).backward()
    host_bytes = {str(d): snap["Total"] for d, snap in after_forward.items()}["meta"]
    assert host_bytes == offload.host_bytes_peak == (layers - 1) * tokens * hidden * 4
    assert offload.host_bytes_in_use == 0
    assert all(p.grad is not None for p in blocks.parameters())
