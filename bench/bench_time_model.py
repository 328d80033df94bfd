"""The time model against measured steps of `python -m megatron_lc.train` on this machine's CPU.

For each configuration: the planner's predicted step (`--machine local`: this machine's rates,
measured once and cached, shared by the run's processes) beside the median measured step of
a short CPU run on the same flags (torchrun, gloo, one thread per process, steps after the
first). The cached local rates are dropped first, so that each configuration's shapes are measured
as the machine is now. Prints a markdown table and writes it as JSON with --json-out.

The packed rows (`--packing documents`) train on a dataset written for the run: documents of the planner's
assumed mix (planning/packed_work.py) scaled to the sample as a 128K-token sample holds them (lengths x 4096 /
131072: a tenth of a sample's pairs inside documents, a few long documents deciding the ranks' imbalance). Their
prediction is the mean over the very samples the measured steps trained on (steps after the first), against
the mean measured step.

    python bench/bench_time_model.py [--steps 4] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ("--model debug --num-layers 2 --hidden-size 512 --num-attention-heads 8 --num-query-groups 2 "
         "--kv-channels 64 --ffn-hidden-size 2048 --vocab-size 8000 --seq-length 4096").split()
STACK = "--recompute-granularity full --offload-mode prefetch --tiled-mlp --tiled-loss".split()
CONFIGS = {
    "cp1": (1, []),
    "cp1 full recompute": (1, ["--recompute-granularity", "full"]),
    "cp1 full stack": (1, STACK),
    "cp2 Ulysses": (2, ["--context-parallel-size", "2"]),
    "cp2 Ulysses full stack": (2, ["--context-parallel-size", "2", *STACK]),
    "cp2 Untied Ulysses full stack": (2, ["--context-parallel-size", "2", "--cp-impl", "untied_ulysses",
                                          "--untied-heads-per-stage", "2", *STACK]),
    "cp2 ring": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "cp4 Ulysses full recompute": (4, ["--context-parallel-size", "4", "--recompute-granularity", "full"]),
    # Sparse offload over 6 layers (5 offloaded: segments of 3 and 2, 4 replays), every block's attention kept; its
    # replays computing their attention, or reading the kept one.
    "cp1 full stack, 6 layers, k=3, kept attention": (1, ["--num-layers", "6", *STACK, "--offload-every-k-layers",
                                                          "3", "--keep-attention-output"]),
    "cp1 full stack, 6 layers, k=3, kept attention read by the replays": (
        1, ["--num-layers", "6", *STACK, "--offload-every-k-layers", "3", "--keep-attention-output",
            "--replay-kept-attention"]),
}


PACKED = ["--packing", "documents", "--split", "100,0,0", "--long-documents", "drop"]
PACKED_CONFIGS = {
    "cp1 packed": (1, []),
    "cp4 ring packed, sequence": (4, ["--context-parallel-size", "4", "--cp-comm-type", "p2p",
                                      "--cp-document-layout", "sequence"]),
    "cp4 ring packed, split": (4, ["--context-parallel-size", "4", "--cp-comm-type", "p2p",
                                   "--cp-document-layout", "split"]),
    "cp4 ring packed, local": (4, ["--context-parallel-size", "4", "--cp-comm-type", "p2p",
                                   "--cp-document-layout", "local"]),
    "cp4 Untied Ulysses packed": (4, ["--context-parallel-size", "4", "--cp-impl", "untied_ulysses",
                                      "--untied-heads-per-stage", "4"]),
}
"""Packed rows: (processes, flags besides PACKED and the data path)."""


def measured_steps_s(world: int, flags: list[str], steps: int) -> list[float]:
    """Step times of a CPU run of `steps` steps (`flags` name the data)."""
    with tempfile.TemporaryDirectory() as log_dir:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                   "--master-port", str(_free_port()), "-m", "megatron_lc.train", *MODEL, *flags,
                   "--device", "cpu", "--train-iters", str(steps), "--log-dir", log_dir]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        subprocess.run(command, check=True, env=env, capture_output=True, text=True)
        lines = (Path(log_dir) / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["step_time_s"] for line in lines if "step_time_s" in line]


def measured_step_s(world: int, flags: list[str], steps: int) -> float:
    """Median step time of a CPU run of `steps` steps on mock data (the first, with its warm-up, left out)."""
    return statistics.median(measured_steps_s(world, [*flags, "--mock-data"], steps)[1:])


def _planned(world: int, flags: list[str]):
    from megatron_lc.planning import cli as estimate_memory
    from megatron_lc.planning.timing import TimeModel

    planner, cfg = estimate_memory.parse([*MODEL, *flags, "--num-gpus", str(world), "--machine", "local"])
    machine = estimate_memory.machine_of(planner, cfg)
    return cfg, TimeModel.for_machine(machine, cfg)


def predicted_step_s(world: int, flags: list[str]) -> dict:
    cfg, model = _planned(world, flags)
    return model.predict(cfg, world).to_json()


def predicted_packed_steps(world: int, flags: list[str], steps: int) -> dict:
    """The predicted step of each measured step after the first (one sample a step: one context-parallel group,
    micro-batch 1), their mean, and the whole mix's prediction."""
    from megatron_lc.planning.packed_work import DocumentMix, document_mix
    from megatron_lc.planning.timing import predict_packed

    cfg, model = _planned(world, flags)
    mix = document_mix(cfg, steps)
    spec = cfg.run_spec(world)
    each = [predict_packed(cfg, world, spec, DocumentMix(mix.samples[k:k + 1], mix.source), model.rates,
                           model.gpus_per_node, model.family) for k in range(1, steps)]
    return {**model.predict(cfg, world).to_json(), "step_s": statistics.mean(t.step_s for t in each),
            "steps_s": [t.step_s for t in each], "imbalance": [t.packed["imbalance_median"] for t in each]}


def write_packed_data(prefix: str, seq_length: int = 4096, documents: int = 3000) -> None:
    """Documents of the assumed mix scaled to a `seq_length` sample as a 131,072-token sample holds them."""
    import numpy as np

    from megatron_lc.data.indexed_dataset import write_dataset
    from megatron_lc.planning.packed_work import assumed_lengths

    lengths = np.maximum(2, assumed_lengths(documents) * seq_length // 131_072)
    rng = np.random.default_rng(0)
    write_dataset(prefix, (rng.integers(1, 8000, size=int(n)) for n in lengths))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None, help="configuration names to run")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    from megatron_lc.planning.calibration import LOCAL_CACHE

    LOCAL_CACHE.unlink(missing_ok=True)  # each configuration's rates measured now, at its own shapes
    rows = []
    print("| configuration | processes | predicted step | measured step | predicted / measured |")
    print("| --- | ---: | ---: | ---: | ---: |")
    data = tempfile.TemporaryDirectory()
    prefix = str(Path(data.name) / "packed_text_document")
    write_packed_data(prefix)
    for name, (world, flags) in [*CONFIGS.items(), *((n, (w, [*f, *PACKED, "--data-path", prefix]))
                                                     for n, (w, f) in PACKED_CONFIGS.items())]:
        if args.only and name not in args.only:
            continue
        if "--packing" in flags:
            predicted = predicted_packed_steps(world, flags, args.steps)
            measured = statistics.mean(measured_steps_s(world, flags, args.steps)[1:])
        else:
            predicted = predicted_step_s(world, flags)
            measured = measured_step_s(world, flags, args.steps)
        ratio = predicted["step_s"] / measured
        rows.append({"name": name, "processes": world, "flags": flags, "predicted": predicted, "measured_s": measured,
                     "ratio": ratio})
        print(f"| {name} | {world} | {predicted['step_s']:.2f} s | {measured:.2f} s | {ratio:.2f} |", flush=True)
    data.cleanup()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
