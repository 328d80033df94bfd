"""The planner's default estimate equals the exact trace on the models, stacks, layouts and lengths the planner is
used for: Untied Ulysses' per-rank projection loops over two ranks against every rank, byte for byte; a ring's
steps 0, 1 and the last against every step, within the 16-byte rng states of the kernel calls not run."""

import pytest

from megatron_lc.arguments import parse_config
from megatron_lc.planning import trace
from megatron_lc.planning.estimate import Machine, estimate
from megatron_lc.planning.fake_world import representative_ranks

STACK = ["--bf16", "--recompute-granularity", "full", "--offload-mode", "prefetch", "--tiled-mlp", "--tiled-loss",
         "--mock-data"]
UNTIED = ["--cp-impl", "untied_ulysses"]
# (model, GPUs, tokens, flags): Untied Ulysses (the rank loops are its), from 512K to 16M tokens, packed or not,
# the optimizer on the GPU or the host. `bench/bench_planner.py --exact` compares every goal of the benchmark
# (32B, 70B on 32 and 64 GPUs with a ring, the lean backward with sparse offload, pipelined stages) the same
# way: these keep the suite short (wide Untied stages: fewer stages trace fewer operations, and the rank loops
# compared are the same in every stage).
RNG_STATE_BYTES = 16
MAX_SKIPPED_CALLS = 2 * 8 * 8
"""Kernel calls of the ring steps not run whose states can be alive at once: two a step, 8 steps, a few layers."""
GRID = {
    "8b-cp4-untied-packed-16m": ("llama3-8b", 4, 16777216, ["--context-parallel-size", "4", *UNTIED, "--packing",
                                                            "documents", "--reset-attention-mask",
                                                            "--untied-heads-per-stage", "16"]),
    "8b-cp8-ring-in-place-2m": ("llama3-8b", 8, 2097152, ["--context-parallel-size", "8", "--cp-comm-type", "p2p",
                                                          "--ring-kv-grads", "in_place"]),
    "70b-cp4-untied-host-optimizer-kept-attention-first-2-512k": ("llama3-70b", 4, 524288, [
        "--context-parallel-size", "4", *UNTIED, "--untied-heads-per-stage", "32", "--optimizer-cpu-offload",
        "--keep-attention-output", "--keep-attention-output-layers", "2"]),
}


def test_representative_ranks_are_two_of_the_group_or_the_whole_of_a_smaller_one():
    assert list(representative_ranks(8)) == [0, 1]
    assert list(representative_ranks(1)) == [0]


def test_the_default_trace_runs_rank_loops_over_representative_ranks_and_exact_over_every_rank(monkeypatch):
    asked = []

    def recording(cp):
        asked.append(cp)
        return representative_ranks(cp)

    monkeypatch.setattr(trace, "representative_ranks", recording)
    cfg = parse_config(["--model", "debug", "--num-layers", "2", "--seq-length", "256", "--context-parallel-size",
                        "4", *UNTIED, "--mock-data"])
    machine = Machine(num_gpus=4, device="cpu", reserve_gib=0.0)
    fast, exact = estimate(cfg, machine), None
    assert asked and set(asked) == {4}
    asked.clear()
    exact = estimate(cfg, machine, exact=True)
    assert asked == []
    assert fast.gpu_bytes_by_category == exact.gpu_bytes_by_category


@pytest.mark.parametrize("name", GRID)
def test_estimate_equals_the_exact_trace(name):
    model, gpus, tokens, flags = GRID[name]
    cfg = parse_config(["--model", model, "--seq-length", str(tokens), *STACK, *flags])
    machine = Machine(num_gpus=gpus, fa3=True)
    fast, exact = estimate(cfg, machine), estimate(cfg, machine, exact=True)
    if "ring" in name:  # the rng states of the steps not run: 16 bytes a kernel call
        for category, exact_bytes in exact.gpu_bytes_by_category.items():
            assert 0 <= exact_bytes - fast.gpu_bytes_by_category[category] <= RNG_STATE_BYTES * MAX_SKIPPED_CALLS
    else:
        assert fast.gpu_bytes_by_category == exact.gpu_bytes_by_category
    assert fast.host_bytes_per_gpu == exact.host_bytes_per_gpu
    assert (fast.fits_gpu, fast.fits_host, fast.peak_phase) == (exact.fits_gpu, exact.fits_host, exact.peak_phase)
