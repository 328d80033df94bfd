"""The memory stack switched on changes neither loss nor gradients: one process, and FSDP + CP."""

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
