"""What the lean backward removes: one real training step per configuration, rank 0's peak measured with
MemTracker (`planning.trace.measure_real_step`), next to the planner's prediction of the same step.

    python -m bench.bench_lean_backward [--seq-length 8192] [--layers 4]

Four gloo processes on CPU, the full memory stack (full recompute, offload, tiled MLP and loss), Untied
Ulysses with one head per rank per stage: cp 4 all-to-all (8 heads, 1 kv head: 2 stages per kv round),
and 2 x 2 (all-to-all in pairs, a ring across; 8 heads, 2 kv heads: 4 stages per kv round), each with the
fast and the lean backward (`--untied-backward lean`; in the ring also `--ring-kv-grads in_place`).
"""

from __future__ import annotations

import argparse

import torch

from bench.common import run_ranks
from megatron_lc.arguments import config_from_values
from megatron_lc.data.loader import Batch
from megatron_lc.devices import Devices
from megatron_lc.parallel_state import ParallelState
from megatron_lc.planning.estimate import Machine, estimate
from megatron_lc.planning.trace import measure_real_step

CPU = Devices(torch.device("cpu"), torch.device("cpu"))
STACK = dict(recompute_granularity="full", offload_mode="prefetch", tiled_mlp=True, tiled_loss=True,
             cp_impl="untied_ulysses", context_parallel_size=4)
LAYOUTS = {
    "cp 4 all-to-all": dict(num_query_groups=1),
    "2 x 2 (ring across)": dict(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]),
}
LEAN = {"cp 4 all-to-all": dict(untied_backward="lean"),
        "2 x 2 (ring across)": dict(untied_backward="lean", ring_kv_grads="in_place")}


def _config(layout: str, lean: bool, seq_length: int, layers: int):
    values = dict(model="debug", num_layers=layers, seq_length=seq_length, mock_data=True, **STACK, **LAYOUTS[layout])
    return config_from_values({**values, **(LEAN[layout] if lean else {})})


def _measure(rank, world, seq_length, layers):
    torch.manual_seed(0)
    out = {}
    for layout in LAYOUTS:
        for lean in (False, True):
            cfg = _config(layout, lean, seq_length, layers)
            pstate = ParallelState(cfg.parallel_dims(world))
            S, cp = seq_length, pstate.cp_size
            tokens = torch.randint(0, cfg.model_config().vocab_size, (1, S // cp))
            positions = (torch.arange(S // cp) + pstate.cp_rank * (S // cp)).unsqueeze(0)
            batch = Batch(tokens, tokens.roll(-1, dims=1), positions, (0, S))
            analysis, _ = measure_real_step(cfg, pstate, batch, CPU)
            out[(layout, lean)] = analysis.peak.total
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    measured = run_ranks(_measure, 4, args.seq_length, args.layers)
    print(f"debug model, {args.layers} layers, {args.seq_length} tokens, 4 gloo processes, rank 0's peak (MiB)")
    print("| layout | fast: measured | lean: measured | lean / fast | fast: planned | lean: planned |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for layout in LAYOUTS:
        fast, lean = measured[(layout, False)], measured[(layout, True)]
        planned = [estimate(_config(layout, x, args.seq_length, args.layers),
                            Machine(num_gpus=4, device="cpu", reserve_gib=0.0)).gpu_peak_bytes for x in (False, True)]
        print(f"| {layout} | {fast / 2**20:.2f} | {lean / 2**20:.2f} | {lean / fast:.3f} | "
              f"{planned[0] / 2**20:.2f} | {planned[1] / 2**20:.2f} |")


if __name__ == "__main__":
    main()
