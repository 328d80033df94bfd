"""The kept attention store is an argument of the attention op, one per block and a record per forward: a call
given no store computes whatever another store is doing, and forwards in flight each recompute from their own."""

import dataclasses

import torch

from megatron_lc.attention.kernels import KERNELS, Kernel, attention
from megatron_lc.attention.local import LocalAttention
from megatron_lc.memory.kept_attention import KeptAttention, KeptRecord
from megatron_lc.models.llama import build_model, get_config
from megatron_lc.models.llama.parallelize import apply_memory_stack
from megatron_lc.testing import make_batch
from tests.exactness import BATCH, CPU
from tests.helpers import parallelize_options


def _counted(kernel: Kernel, calls: list) -> Kernel:
    """`kernel`, its forward calls counted."""
    return Kernel("counted-" + kernel.name, lambda *a, **k: (calls.append(1), kernel.forward(*a, **k))[1],
                  kernel.backward)


def _qkv(seed: int, T: int = 96, H: int = 4, Hkv: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, d, generator=g).requires_grad_() for h in (H, Hkv, Hkv)]


def test_an_attention_call_given_no_store_computes_inside_another_stores_keep_and_replay():
    """A call without a store (another model's, a probe) inside a block's forward and recompute neither keeps
    nor takes: under a per-thread store it would keep its output in the block's record, and in the recompute,
    called first, take the block's output as its own."""
    calls, cu = [], (0, 40, 96)
    kernel = _counted(KERNELS["reference"], calls)
    store, record = KeptAttention(layer_idx=3), KeptRecord(offload=None)
    mine, other = _qkv(0), _qkv(1)
    with store.keeping(record):
        kept_out = attention(*mine, cu, kernel, kept=store)
        other_out = attention(*other, cu, kernel)
    assert len(calls) == 2 and len(record) == 1 and store.mode == "off"

    with store.replaying(record):
        other_again = attention(*other, cu, kernel)  # first: it must not take the block's entry
        taken = attention(*mine, cu, kernel, kept=store)
    assert len(calls) == 3  # the call without a store ran its kernel; the block's took its kept output
    assert torch.equal(other_again, other_out) and torch.equal(taken, kept_out) and len(record) == 0

    dout = torch.randn(kept_out.shape, generator=torch.Generator().manual_seed(2))
    taken.backward(dout)
    grads = [t.grad.clone() for t in mine]
    for t in mine:
        t.grad = None
    attention(*mine, cu, KERNELS["reference"]).backward(dout)  # the same gradients as from a recomputed output
    for got, want in zip(grads, (t.grad for t in mine)):
        assert torch.equal(got, want)

    attention(*mine, cu, kernel, kept=store)  # outside the wrapper's contexts a store is off: computed, not kept
    assert len(calls) == 4 and len(record) == 0 and store.mode == "off"


def _counted_model(opts, calls):
    config = dataclasses.replace(get_config("debug"), num_layers=3)
    model = build_model(config, device="cpu", seed=0)
    apply_memory_stack(model, opts, CPU)
    model.set_attention_backend(LocalAttention(config.kv_channels, _counted(model.layers[0].self_attn.backend.kernel,
                                                                            calls)))
    return model


def _in_flight_grads(opts, calls):
    """Gradients of one backward over two forwards of one model, after a third forward whose backward never ran."""
    model = _counted_model(opts, calls)
    first, second = (make_batch(**dict(BATCH, seed=s))[0] for s in (1, 2))
    model(first.input_ids, first.position_ids, first.labels, first.cu_seqlens)  # dropped: no backward
    (loss_a, _), (loss_b, _) = (model(b.input_ids, b.position_ids, b.labels, b.cu_seqlens) for b in (first, second))
    (loss_a + 2 * loss_b).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_forwards_in_flight_each_recompute_from_their_own_kept_attention():
    """Two forwards of one model before its backward (after a forward never backpropagated): each block's
    recompute takes what its own forward kept, bit for bit the gradients of recomputing the attention."""
    keep = parallelize_options(recompute_granularity="full", keep_attention_output=True)
    recompute = parallelize_options(recompute_granularity="full")
    calls = []
    want = _in_flight_grads(recompute, calls)
    assert len(calls) == 3 * 3 + 2 * 3  # three forwards, two recomputes, of 3 blocks
    del calls[:]
    got = _in_flight_grads(keep, calls)
    assert len(calls) == 3 * 3  # the forwards only
    for n, g in got.items():
        assert torch.equal(g, want[n]), n
