"""checkpoint_residual_block: the same loss and gradients as the plain block, and one
`[tokens, hidden]` gradient buffer less in its backward than checkpoint_block."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_lc.memory import OffloadScheduler, checkpoint_block
from megatron_lc.memory.recompute import checkpoint_residual_block
from megatron_lc.memory.measure import measure_peak

CPU = torch.device("cpu")


class TwoBranchBlock(nn.Module):
    """x + mix(norm1(x)), then + mlp(norm2(.)): the shape of a transformer block."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
        self.mix = nn.Linear(hidden, hidden, bias=False)
        self.up, self.down = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)

    def branch1(self, x):
        return self.mix(self.norm1(x))

    def branch2(self, h):
        return self.down(F.silu(self.up(self.norm2(h))))

    def forward(self, x):
        h = x + self.branch1(x)
        return h + self.branch2(h)


def _stack(n=3, hidden=16, ffn=32):
    torch.manual_seed(0)
    return nn.ModuleList(TwoBranchBlock(hidden, ffn) for _ in range(n))


def _run(blocks, x, mode, offload=None, owned=True):
    for i, b in enumerate(blocks):
        if mode == "plain":
            x = b(x)
        elif mode == "checkpoint":
            x = checkpoint_block(b, x, offload=offload, layer_idx=i)
        else:
            x = checkpoint_residual_block((b.branch1, b.branch2), x, offload=offload, layer_idx=i,
                                          owns_output_grad=owned)
    return x


def _loss_and_grads(blocks, mode, offload=None, owned=True, tokens=64):
    x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = (_run(blocks, x, mode, offload, owned) ** 2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in blocks.named_parameters()} | {"x": x.grad.clone()}
    blocks.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("owned", [True, False])
@pytest.mark.parametrize("offload", [None, "prefetch", "early", "on-demand"])
def test_residual_checkpoint_gives_the_plain_blocks_loss_and_gradients(owned, offload):
    blocks = _stack()
    want_loss, want = _loss_and_grads(blocks, "plain")
    scheduler = None if offload is None else OffloadScheduler(3, keep_last=1, accelerator=CPU,
                                                              prefetch=offload != "on-demand",
                                                              prefetch_early=offload == "early")
    loss, got = _loss_and_grads(blocks, "residual", scheduler, owned)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_residual_checkpoint_keeps_one_gradient_buffer_less_in_backward():
    """Tokens x hidden dominate: the block's own input gradient accumulates into the one arriving."""
    tokens, hidden = 8192, 16
    buffer = tokens * hidden * 4
    peaks = {}
    for mode in ("checkpoint", "residual"):
        blocks = _stack(n=3, hidden=hidden, ffn=hidden)
        x = torch.randn(tokens, hidden, requires_grad=True)

        def step():
            _run(blocks, x, mode).sum().backward()

        peaks[mode] = measure_peak(step, blocks).total("cpu")
    # One buffer less, up to the small per-row tensors (norm statistics) the two schedules hold differently.
    assert peaks["residual"] <= peaks["checkpoint"] - 0.9 * buffer, peaks


def test_without_grad_the_branches_run_plainly():
    blocks = _stack(n=1)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(_run(blocks, x, "residual"), _run(blocks, x, "plain"), rtol=0, atol=0)


def _backward_peak_and_prefetched(mode, tokens=8192, hidden=16, **scheduler):
    """A 4-block step's peak and whether layer 1's input was back on the accelerator during block 2's backward."""
    blocks = _stack(n=4, hidden=hidden, ffn=hidden)
    offload = OffloadScheduler(4, keep_last=1, accelerator=CPU, **scheduler)
    x = torch.randn(tokens, hidden, requires_grad=True)
    started = []
    blocks[2].mix.weight.register_post_accumulate_grad_hook(  # inside block 2's backward, its last branch
        lambda _: started.append([h.on_accelerator is not None for h in offload._pending.get(1, [])]))

    def step():
        (_run(blocks, x, mode, offload) ** 2).mean().backward()

    return measure_peak(step, blocks).total("cpu"), started


@pytest.mark.parametrize("mode", ["checkpoint", "residual"])
def test_offload_prefetch_costs_no_memory_at_a_blocks_backward_peak(mode):
    """The previous layer's input comes back once a block's backward is done: prefetch on and on demand
    peak alike (a prefetch at the start of the backward kept one more block input through it)."""
    (prefetch, started), (on_demand, _) = (_backward_peak_and_prefetched(mode, prefetch=p) for p in (True, False))
    assert started == [[False]], "layer 1's input came back during block 2's backward"
    assert prefetch == on_demand, (prefetch, on_demand)


@pytest.mark.parametrize("mode", ["checkpoint", "residual"])
def test_early_prefetch_brings_the_previous_input_back_during_a_blocks_backward_for_one_input_more(mode):
    """With prefetch_early the previous layer's input is asked for when a block's backward starts, so on a GPU
    the copy runs during that backward; it is then resident through the block's peak: one block input more."""
    late, _ = _backward_peak_and_prefetched(mode)
    early, started = _backward_peak_and_prefetched(mode, prefetch_early=True)
    assert started == [[True]], started
    # One block input more, up to the small per-row tensors (norm statistics) that move the peak a little.
    assert early - late == pytest.approx(8192 * 16 * 4, rel=0.01), (early, late)


def test_a_branch_without_input_gradient_leaves_the_callers_gradient_untouched():
    """A branch whose output does not depend on its input adds nothing; the gradient arriving from above is
    still the caller's (not owned), so the next branch must not accumulate into it in place."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False)
    bias = nn.Parameter(torch.randn(8))
    x = torch.randn(4, 8, requires_grad=True)
    y = checkpoint_residual_block((lin, lambda t: bias.expand_as(t)), x, owns_output_grad=False)
    grad_out = torch.randn(4, 8)
    kept = grad_out.clone()
    y.backward(grad_out)
    assert torch.equal(grad_out, kept), "the caller's gradient was written to"
    torch.testing.assert_close(x.grad, grad_out + grad_out @ lin.weight, rtol=1e-6, atol=1e-6)
