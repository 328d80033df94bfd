"""`estimate(..., stop_when_over=True)`: a step whose fewer traced layers are already over a budget is answered by
them, marked `at_least`; auto-fit, which only needs to know what does not fit, saves that step's second trace."""

import dataclasses

import pytest

from megatron_lc.arguments import parse_config
from megatron_lc.planning.estimate import GIB, Machine, estimate, traced_layer_counts
from megatron_lc.planning.estimate_pool import EstimatePool

TINY = ["--model", "debug", "--num-layers", "10", "--hidden-size", "128", "--ffn-hidden-size", "256",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "2048", "--device", "cpu",
        "--mock-data", "--seq-length", "8192"]
STACKS = {
    "plain": [],
    "full stack": ["--context-parallel-size", "2", "--recompute-granularity", "full", "--offload-mode", "prefetch",
                   "--tiled-mlp", "--tiled-loss"],
    "ring": ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--recompute-granularity", "full"],
}


@pytest.mark.parametrize("name", STACKS)
def test_the_fewer_layers_hold_no_more_than_the_step_and_their_answer_is_kept_only_when_over(name):
    cfg = parse_config([*TINY, *STACKS[name]])
    full = estimate(cfg, Machine(num_gpus=2, device="cpu", reserve_gib=0))
    fewer_layers = traced_layer_counts(cfg.run_spec(2))[0]
    # A card a tenth of the step's peak (the fewer layers are over it too: answered by them) and one just under
    # it (the fewer layers fit: the second trace runs and the answer is the full one).
    for fraction, stops in ((0.1, True), (0.999, False)):
        machine = Machine(num_gpus=2, device="cpu", reserve_gib=0, gpu_memory_gib=full.gpu_peak_bytes / GIB * fraction)
        stopped = estimate(cfg, machine, stop_when_over=True)
        whole = dataclasses.replace(full, machine=machine)
        assert stopped.at_least == stops and not whole.fits
        if stops:
            assert stopped.traced_layers == (fewer_layers,) and not stopped.fits
            assert stopped.gpu_peak_bytes <= whole.gpu_peak_bytes
            assert stopped.host_bytes_per_gpu <= whole.host_bytes_per_gpu
        else:
            assert (stopped.gpu_bytes_by_category, stopped.host_bytes_per_gpu) == (
                whole.gpu_bytes_by_category, whole.host_bytes_per_gpu)


def test_a_pool_that_needs_every_byte_traces_again_what_a_stopped_search_left_at_least():
    cfg = parse_config(TINY)
    full = estimate(cfg, Machine(num_gpus=2, device="cpu", reserve_gib=0))
    machine = Machine(num_gpus=2, device="cpu", reserve_gib=0, gpu_memory_gib=full.gpu_peak_bytes / GIB * 0.1)
    pool = EstimatePool()
    pool.stop_when_over = True
    assert pool(cfg, machine).at_least
    pool.stop_when_over = False
    again = pool(cfg, machine)
    assert not again.at_least and again.gpu_peak_bytes == full.gpu_peak_bytes and pool.traced == 2
