"""The planner's prediction equals the peak MemTracker measures in a real CPU run of the same step.

Real runs: gloo processes, real tensors, the same code (`run_tracked_step`), the CPU
attention kernels. The planner traces the same configurations with fake tensors on a
fake process group (extrapolating from 4 and 5 layers where the model has more) and
must land within 5% of the measured accelerator peak; host bytes (offloaded block
inputs) must match the offload scheduler's count.
"""

import pytest
import torch

from megatron_lc.attention.registry import CP_IMPLS
from megatron_lc.arguments import config_from_values
from megatron_lc.data.loader import Batch
from megatron_lc.devices import Devices
from megatron_lc.parallel_state import ParallelState
from megatron_lc.planning.estimate import Machine, estimate
from megatron_lc.planning.trace import measure_real_step, parallel_dims
from tests.helpers import rank_zero_result

CPU = Devices(torch.device("cpu"), torch.device("cpu"))
WORLD = 4
# Debug shapes; the "-6-layers" configurations have more layers than the planner traces (4 and 5), so its
# extrapolation is checked against a real run of all of them.
BASE = dict(model="debug", num_layers=2, seq_length=256, mock_data=True, clip_grad=1.0)
FULL_STACK = dict(recompute_granularity="full", offload_mode="prefetch", tiled_mlp=True, tiled_loss=True,
                  tiled_mlp_tiles=3, tiled_loss_tiles=5)
DISTRIBUTED = {
    "fsdp-cp1": dict(context_parallel_size=1),
    "ulysses-cp2-checkpoint": dict(context_parallel_size=2, recompute_granularity="full"),
    "ulysses-cp4-tiling": dict(context_parallel_size=4, tiled_mlp=True, tiled_loss=True, tiled_mlp_tiles=3,
                               tiled_loss_tiles=5),
    "ulysses-cp4-full-stack-6-layers": dict(context_parallel_size=4, num_layers=6, **FULL_STACK),
}
if "untied_ulysses" in CP_IMPLS:
    DISTRIBUTED["untied-cp4-full-stack-fetch-on-demand"] = dict(context_parallel_size=4, cp_impl="untied_ulysses",
                                                                **{**FULL_STACK, "offload_mode": "on_demand"})
# Sparse offload, k = 2: the planner traces 6 and 8 layers (congruent to 10 modulo 2) and extrapolates to 10.
DISTRIBUTED["ulysses-cp4-full-stack-sparse-k2-10-layers"] = dict(context_parallel_size=4, num_layers=10,
                                                                 offload_every_k_layers=2, **FULL_STACK)
# Sparse offload k = 3 whose replays read the kept attention outputs: the planner traces 8 and 11 layers and
# extrapolates to 14; every block's output and lse on the host, one input per segment.
DISTRIBUTED["untied-cp4-full-stack-sparse-k3-replaying-kept-attention-14-layers"] = dict(
    context_parallel_size=4, cp_impl="untied_ulysses", num_layers=14, offload_every_k_layers=3,
    keep_attention_output=True, replay_kept_attention=True, **FULL_STACK)
DISTRIBUTED["ring-p2p-cp4-full-stack"] = dict(context_parallel_size=4, cp_comm_type="p2p", **FULL_STACK)
# Early prefetch: the previous layer's input resident through each block's backward.
DISTRIBUTED["ulysses-cp2-full-stack-prefetch-early"] = dict(context_parallel_size=2,
                                                            **{**FULL_STACK, "offload_mode": "early"})
# Pipelined stages: a second set of stage buffers, and send buffers alive through the kernels.
DISTRIBUTED["untied-cp4-overlap-full-stack"] = dict(context_parallel_size=4, cp_impl="untied_ulysses",
                                                    untied_overlap_stages=True, num_query_groups=1, **FULL_STACK)
DISTRIBUTED["untied-2x2-ring-full-stack"] = dict(context_parallel_size=4, cp_impl="untied_ulysses",
                                                 cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2],
                                                 **FULL_STACK)
# The lean backward: Untied Ulysses' dK/dV per stage and its output freed by stage (2 stages per kv round), and in
# a ring the fp32 accumulators rotated in place.
DISTRIBUTED["untied-cp4-lean-full-stack"] = dict(context_parallel_size=4, cp_impl="untied_ulysses",
                                                 untied_backward="lean", num_query_groups=1, **FULL_STACK)
DISTRIBUTED["untied-2x2-ring-lean-full-stack"] = dict(context_parallel_size=4, cp_impl="untied_ulysses",
                                                      cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2],
                                                      untied_backward="lean", ring_kv_grads="in_place", **FULL_STACK)
# The optimizer on the host: master weights, moments and gradients leave the accelerator's peak for the host's.
DISTRIBUTED["fsdp-cp2-full-stack-optimizer-on-the-host"] = dict(context_parallel_size=2, optimizer_cpu_offload=True,
                                                                **FULL_STACK)
SINGLE = {"one-rank": {}, "one-rank-full-stack": dict(FULL_STACK),
          "one-rank-optimizer-on-the-host": dict(optimizer_cpu_offload=True),
          # Kept attention outputs and lse: offloaded with the block inputs (host bytes about double), or on the GPU.
          "one-rank-full-stack-kept-attention": dict(FULL_STACK, keep_attention_output=True),
          "one-rank-kept-attention-on-the-gpu": dict(recompute_granularity="full", keep_attention_output=True),
          "one-rank-full-stack-sparse-k2-replaying-kept-attention": dict(FULL_STACK, num_layers=4,
                                                                         offload_every_k_layers=2,
                                                                         keep_attention_output=True,
                                                                         replay_kept_attention=True),
          # The same over 6 layers with only the first 2 keeping theirs: the others' replays compute attention.
          "one-rank-full-stack-sparse-k2-replaying-kept-attention-first-2-of-6": dict(
              FULL_STACK, num_layers=6, offload_every_k_layers=2, keep_attention_output=True,
              keep_attention_output_layers=2, replay_kept_attention=True),
          # The first 2 of 6 blocks keep theirs: the planner traces all keeping (its GPU peak bounds this one's)
          # and takes the other offloaded blocks' arenas off the host.
          "one-rank-full-stack-kept-attention-first-2-of-6": dict(FULL_STACK, num_layers=6, keep_attention_output=True,
                                                                  keep_attention_output_layers=2),
          "one-rank-kept-attention-on-the-gpu-first-2-of-6": dict(recompute_granularity="full", num_layers=6,
                                                                  keep_attention_output=True,
                                                                  keep_attention_output_layers=2)}


def _config(name):
    return config_from_values({**BASE, **DISTRIBUTED.get(name, SINGLE.get(name, {}))})


def _real_batch(cfg, pstate):
    """Random tokens of this rank's slice, one document per sample (the planner's shapes)."""
    B, S, cp = cfg.data.micro_batch_size, cfg.data.seq_length, pstate.cp_size
    g = torch.Generator().manual_seed(pstate.dp_rank)
    tokens = torch.randint(0, cfg.model_config().vocab_size, (B, S // cp), generator=g)
    positions = (torch.arange(S // cp) + pstate.cp_rank * (S // cp)).expand(B, S // cp).contiguous()
    return Batch(tokens, tokens.roll(-1, dims=1), positions, tuple(range(0, B * S + 1, S)))


def measure(cfg, world_size):
    """(accelerator peak, host peak) of one real training step, as the tracker measures it."""
    pstate = ParallelState(parallel_dims(cfg, world_size))
    analysis, host_peak = measure_real_step(cfg, pstate, _real_batch(cfg, pstate), CPU)
    return analysis.peak.total, host_peak


def _measure_all(rank, world_size, names):
    torch.manual_seed(0)
    return {name: measure(_config(name), world_size) for name in names}


@pytest.fixture(scope="module")
def measured():
    """Real peaks of every configuration: the distributed ones in one group of gloo processes."""
    results = {name: tuple(v) for name, v in rank_zero_result(_measure_all, WORLD, sorted(DISTRIBUTED)).items()}
    results.update({name: measure(_config(name), 1) for name in SINGLE})
    return results


@pytest.mark.parametrize("name", [*DISTRIBUTED, *SINGLE])
def test_prediction_matches_measured_peak(name, measured):
    world_size = WORLD if name in DISTRIBUTED else 1
    predicted = estimate(_config(name), Machine(num_gpus=world_size, device="cpu", reserve_gib=0.0))
    real_peak, real_host = measured[name]
    print(f"\n{name}: predicted {predicted.gpu_peak_bytes:,} B, measured {real_peak:,} B "
          f"({predicted.gpu_peak_bytes / real_peak - 1:+.2%}); host {predicted.host_bytes_per_gpu:,} vs {real_host:,}")
    assert predicted.gpu_peak_bytes == pytest.approx(real_peak, rel=0.05)
    assert predicted.host_bytes_per_gpu == pytest.approx(real_host, rel=0.01, abs=4096)
