"""The memory stack switched on changes neither loss nor gradients: one process, and FSDP + CP."""

import dataclasses

import pytest
import torch

from megatron_lc.models.llama import build_model, get_config
from megatron_lc.models.llama.parallelize import ParallelizeOptions, apply_memory_stack
from megatron_lc.parallel_state import ParallelDims, ParallelState
from megatron_lc.training.step import forward_backward
from tests.helpers import make_batch, run_distributed
from tests.parallel.test_fsdp_ulysses_exactness import BATCH, CPU, check_against_reference

STACKS = {
    "full": ParallelizeOptions(recompute_granularity="full"),
    "selective": ParallelizeOptions(recompute_granularity="selective"),
    "full+offload": ParallelizeOptions(recompute_granularity="full", offload_activations=True),
    "tiled-mlp": ParallelizeOptions(mlp_tiles=3),
    "tiled-loss": ParallelizeOptions(loss_tiles=5),
    "everything": ParallelizeOptions(recompute_granularity="full", offload_activations=True, mlp_tiles=3,
                                     loss_tiles=5),
    "everything-fetch-on-demand": ParallelizeOptions(recompute_granularity="full", offload_activations=True,
                                                     offload_prefetch=False, mlp_tiles=3, loss_tiles=5),
}


def _loss_and_grads(opts):
    config = get_config("debug")
    model = build_model(config, device="cpu", seed=0)
    apply_memory_stack(model, opts, CPU)
    batch, _ = make_batch(**BATCH)
    result = forward_backward(model, [batch], ParallelState(ParallelDims(world_size=1)), CPU.accelerator)
    return result.loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_memory_technique_matches_plain_model_in_one_process(stack):
    ref_loss, ref_grads = _loss_and_grads(ParallelizeOptions())
    loss, grads = _loss_and_grads(STACKS[stack])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_offload_requires_full_recompute():
    with pytest.raises(ValueError, match="--recompute-granularity full"):
        ParallelizeOptions(offload_activations=True).validate()


def test_fetch_on_demand_requires_offload():
    with pytest.raises(ValueError, match="--no-offload-prefetch .* needs --offload-activations"):
        ParallelizeOptions(recompute_granularity="full", offload_prefetch=False).validate()


@pytest.mark.parametrize("world, cp, stack", [(2, 2, "everything"), (4, 4, "everything"),
                                              (2, 2, "everything-fetch-on-demand")],
                         ids=["cp2", "cp4", "cp2-fetch-on-demand"])
def test_whole_stack_with_fsdp_and_ulysses_matches_single_process(world, cp, stack):
    run_distributed(check_against_reference, world, get_config("debug"), cp, STACKS[stack], BATCH)


def test_selective_recompute_with_fsdp_and_ulysses_matches_single_process():
    run_distributed(check_against_reference, 2, get_config("debug"), 2, STACKS["selective"], BATCH)


# --- sparse offload: every k-th block input kept, the others recomputed from it ------------------------

SPARSE_CONFIG = dataclasses.replace(get_config("debug"), num_layers=4)
"""Layers 0-2 offload (the last keeps its input on the accelerator): k = 2 makes segments {0, 1}, {2};
k = 3 makes {0, 1, 2}: a replay of two blocks, the first of them gathered and sharded again."""


def _sparse(k, **more):
    return ParallelizeOptions(recompute_granularity="full", offload_activations=True, offload_every_k_layers=k,
                              **more)


def _sparse_loss_and_grads(opts):
    model = build_model(SPARSE_CONFIG, device="cpu", seed=0)
    offload = apply_memory_stack(model, opts, CPU)
    batch, _ = make_batch(**BATCH)
    result = forward_backward(model, [batch], ParallelState(ParallelDims(world_size=1)), CPU.accelerator)
    return result.loss, {n: p.grad for n, p in model.named_parameters()}, offload


@pytest.mark.parametrize("k, prefetch, slots", [(2, True, 2), (2, False, 2), (3, True, 1), (7, True, 1)])
def test_sparse_offload_is_bit_identical_to_keeping_every_input_with_k_times_fewer_on_the_host(k, prefetch, slots):
    ref_loss, ref_grads, _ = _sparse_loss_and_grads(ParallelizeOptions())
    dense_loss, dense_grads, dense = _sparse_loss_and_grads(_sparse(1, mlp_tiles=3, loss_tiles=5))
    loss, grads, offload = _sparse_loss_and_grads(_sparse(k, offload_prefetch=prefetch, mlp_tiles=3, loss_tiles=5))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert torch.equal(loss, dense_loss)  # the replay is the forward again: not close, equal
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
        assert torch.equal(g, dense_grads[n]), n
    per_input = dense.host_bytes_peak // 3
    assert offload.host_bytes_peak == slots * per_input and offload.host_bytes_in_use == 0
    assert offload.host_bytes_reserved == slots * per_input


def test_sparse_offload_requires_offload():
    with pytest.raises(ValueError, match="--offload-every-k-layers .* needs --offload-activations"):
        ParallelizeOptions(recompute_granularity="full", offload_every_k_layers=2).validate()
    with pytest.raises(ValueError, match="--offload-every-k-layers 0: expected an integer >= 1"):
        _sparse(0).validate()


SPARSE_CASES = {  # name: (cp, cp_ring, options)
    "ulysses-cp2": (2, 1, _sparse(2, mlp_tiles=3, loss_tiles=5)),
    "untied-cp2-k3": (2, 1, _sparse(3, cp_impl="untied_ulysses", heads_per_stage=4, mlp_tiles=3, loss_tiles=5)),
    "ring-cp2": (2, 2, _sparse(2, mlp_tiles=3, loss_tiles=5, offload_prefetch=False)),
    "fsdp-dp2-k3": (1, 1, _sparse(3, loss_tiles=5)),
}


def _sparse_cases(rank, world):
    for name, (cp, ring, opts) in SPARSE_CASES.items():
        try:
            check_against_reference(rank, world, SPARSE_CONFIG, cp, opts, BATCH, 2, ring)
        except Exception as e:
            raise AssertionError(f"case {name}: {e}") from e


def test_sparse_offload_with_fsdp_and_every_context_parallel_backend_matches_single_process():
    """2 ranks, one after the other in the same processes: Ulysses, Untied Ulysses (norm and o_proj folded into
    it), ring, FSDP alone; with tiled MLP and loss, prefetch and fetch on demand; two optimizer steps each."""
    run_distributed(_sparse_cases, 2)
