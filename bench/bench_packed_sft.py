#!/usr/bin/env python3
"""Packed fine-tuning on a context-parallel group of 4: the document layouts against the sequence's ring,
Ulysses, Untied Ulysses and DeepSpeed's ALST, on one packed sample of the bench mix.

    python bench/bench_packed_sft.py --peer-python /tmp/dsvenv/bin/python --json out.json

The sample: `bench/bench_packing.py`'s length mix (`realistic_lengths`) with every length divided by
`--scale-from` / `--seq-length` (1,048,576 / 65,536 = 16: median 94 tokens, the long documents 1K-8K, so the
mix's shape at 1M tokens holds at 64K), the documents that fit packed with `megatron_lc.data.packing.pack_epoch`
and its first sample taken (the room it leaves is one padding document). Random token ids (seed 0); labels: the
next token inside each document, none for a document's last token or the padding; position ids restart at 0 in
every document. Every row sees these tokens.

Rows (`--world` 4 gloo ranks, cp 4, fp32, FSDP2, micro batch 1; the stack of bench/bench_vs_alst.py: full
recompute, MLP and loss tiles from the project's chunk planner, whose defaults are ALST's rules; a full training
step: forward, backward, torch's AdamW, `train_step`):
    ring, sequence       `--cp-comm-type p2p`, the sequence cut into 2R chunks whatever its documents (before)
    ring, split          `--cp-document-layout split`: every document cut head-tail over the ring
    ring, local          `--cp-document-layout local`: short documents whole on one ring rank, long ones cut
    untied ulysses       `--cp-comm-type a2a --cp-impl untied_ulysses`
    ulysses              `--cp-comm-type a2a --cp-impl ulysses`
    ALST (DeepSpeed)     bench/bench_vs_alst.py's peer worker (ZeRO-3 + Ulysses SP + checkpointing + TiledMLP +
                         ArcticTraining's tiled loss) on the same weights and tokens, with packed position ids;
                         what its attention computes for the documents is printed with its row (`peer_attention`
                         in the JSON; see bench_vs_alst.peer_worker).
All our rows run in one launch, alternated step by step (each row's step between barriers); the peer in its own
launch after it. Per row: the median wall seconds of the timed steps; the seconds each rank spent in the
attention kernel (ours: a timing wrapper around the local kernel, forward incl. recompute and backward, so the
exchanges of Ulysses and the ring are outside it and the ring's kernel calls inside; the peer: the core attention
under DeepSpeed's all-to-all, forward incl. recompute, and its backward between two autograd markers), max and
mean over the ranks, in wall seconds and in the calling thread's CPU seconds (what the kernel computed, whatever
else the cores ran meanwhile: on a machine shared with other work the steadier figure); the slowest rank's CPU
seconds of the step (the process's, gloo's threads included); the max / mean attention pairs per rank from `packed_rank_work` (what the layout gives each
rank to compute); the first step's loss and grad norm. Our rows compute the same function: their first losses
must agree within `--loss-tol`. The peer's loss is its own numerics (HF's rotary and loss): printed beside ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from bench.bench_vs_alst import (IGNORE_INDEX, _StepTimer, _write_json, add_worker_flags, launch,  # noqa: E402
                                 our_config, write_peer_weights)

ROWS = {  # name -> (cp_comm_type, cp_impl, document layout)
    "ring, sequence (p2p)": ("p2p", "ulysses", "sequence"),
    "ring, split": ("p2p", "ulysses", "split"),
    "ring, local": ("p2p", "ulysses", "local"),
    "untied ulysses (a2a)": ("a2a", "untied_ulysses", "sequence"),
    "ulysses (a2a)": ("a2a", "ulysses", "sequence"),
}
BASELINE = "ring, sequence (p2p)"
PEER = "ALST (DeepSpeed Ulysses SP)"


def packed_sample(seq_length: int, scale_from: int, documents: int, seed: int) -> list[int]:
    """The first packed sample of the scaled bench mix: its document boundaries 0 ... seq_length (the room left,
    if any, one padding document at the end)."""
    import numpy as np

    from bench.bench_packing import realistic_lengths
    from megatron_lc.data.packing import pack_epoch

    lengths = np.maximum(realistic_lengths(documents, seed) * seq_length // scale_from, 1)
    lengths = lengths[lengths <= seq_length]
    packed = pack_epoch(lengths, seq_length)
    first = packed["documents"][packed["sample_starts"][0]:packed["sample_starts"][1]]
    bounds = [0, *np.cumsum(lengths[first]).tolist()]
    return bounds if bounds[-1] == seq_length else [*bounds, seq_length]


def prepare(work: Path) -> None:
    """work/hf (the peer's weights, via the project's conversion), work/tokens.pt (the packed sample),
    work/prepared.json (tile counts, documents, each layout's attention pairs per rank)."""
    import torch

    from megatron_lc.context_layout import context_layout_from_flags, packed_rank_work
    from megatron_lc.memory.chunks import plan_chunks
    from megatron_lc.models.llama import count_parameters

    spec = json.loads((work / "spec.json").read_text())
    S, world = spec["seq_length"], spec["world"]
    config, model = write_peer_weights(work, spec)
    cu = packed_sample(S, spec["scale_from"], spec["documents"], spec["seed"])
    padding = S - cu[-2] if spec["padding"] and len(cu) > 1 else 0
    g = torch.Generator().manual_seed(spec["seed"])
    input_ids = torch.randint(0, config.vocab_size, (1, S), generator=g)
    labels = torch.full((1, S), IGNORE_INDEX)
    position_ids = torch.zeros((1, S), dtype=torch.long)
    for a, b in zip(cu, cu[1:]):
        position_ids[0, a:b] = torch.arange(b - a)
        labels[0, a:b - 1] = input_ids[0, a + 1:b]
    if padding:  # the room pack_epoch left: no loss on it
        labels[0, S - padding:] = IGNORE_INDEX
    torch.save({"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "cu_seqlens": cu},
               work / "tokens.pt")
    local = S // world
    plan = plan_chunks(local, config.hidden_size, config.ffn_hidden_size, config.vocab_size, 4,
                       mlp_tiles=spec["mlp_tiles"], loss_tiles=spec["loss_tiles"])
    pairs = {}
    for name, (comm, _, documents) in ROWS.items():
        work_per_rank = packed_rank_work(context_layout_from_flags(world, comm, documents=documents), cu, S)
        pairs[name] = [w.pairs for w in work_per_rank]
    lengths = [b - a for a, b in zip(cu, cu[1:])][:len(cu) - 1 - bool(padding)]
    _write_json(work / "prepared.json", {
        "parameters": count_parameters(model), "mlp_tiles": plan.mlp_tiles, "loss_tiles": plan.loss_tiles,
        "local_tokens": local, "documents": len(lengths), "padding_tokens": padding,
        "median_document": statistics.median(lengths), "longest_document": max(lengths),
        "valid_labels": int((labels != IGNORE_INDEX).sum()), "pairs_per_rank": pairs,
        "pairs_share_of_causal": sum(pairs["ulysses (a2a)"]) / (S * (S + 1) / 2)})


# --- ours: every row in one launch -----------------------------------------------------------------


def _timed_kernels(seconds: list):
    """The kernel table with every kernel wrapped to add its wall seconds (forward and backward) to seconds[0] and
    this thread's CPU seconds to seconds[1] (what the kernel computed, whatever else the cores ran meanwhile)."""
    from megatron_lc.attention.kernels import KERNELS, Kernel

    def timed(fn):
        def call(*args, **kwargs):
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[0] += time.perf_counter() - start
                seconds[1] += time.thread_time() - cpu_start
        return call

    return {name: Kernel(k.name, timed(k.forward), timed(k.backward)) for name, k in KERNELS.items()}


def ours_worker(work: Path, tag: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from megatron_lc.attention.context_parallel import ContextParallel
    from megatron_lc.devices import Devices
    from megatron_lc.entry import exit_process
    from megatron_lc.memory.stack import MemoryStack
    from megatron_lc.models.llama import build_model
    from megatron_lc.models.llama.parallelize import ParallelizeOptions, materialize, parallelize_llama
    from megatron_lc.parallel_state import ParallelDims, ParallelState
    from megatron_lc.testing import Batch, shard_batch
    from megatron_lc.training.optim import build_optimizer
    from megatron_lc.training.step import train_step

    spec = json.loads((work / "spec.json").read_text())
    prepared = json.loads((work / "prepared.json").read_text())
    S = spec["seq_length"]
    cpu = Devices(torch.device("cpu"), torch.device("cpu"))
    config = our_config(spec)
    full = torch.load(work / "tokens.pt")
    cu = tuple(full["cu_seqlens"])
    batch = Batch(full["input_ids"], full["labels"], full["position_ids"], cu)
    reference_state = build_model(config, device="cpu", seed=0).state_dict()
    seconds = [0.0, 0.0]
    kernels = _timed_kernels(seconds)
    rows = {}
    for name, (comm, impl, documents) in ROWS.items():
        pstate = ParallelState(ParallelDims(world_size=world, cp=world, cp_ring=world if comm == "p2p" else 1))
        opts = ParallelizeOptions(
            cp=ContextParallel(impl=impl, documents=documents), seq_length=S, kernels=kernels,
            memory=MemoryStack(recompute_granularity="full", mlp_tiles=prepared["mlp_tiles"],
                               loss_tiles=prepared["loss_tiles"]))
        model = build_model(config, device="meta")
        parallelize_llama(model, pstate, opts, cpu)
        materialize(model, cpu)
        set_model_state_dict(model, reference_state, options=StateDictOptions(full_state_dict=True))
        optimizer = build_optimizer(model, lr=spec["lr"], weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
        layout = dataclasses.replace(pstate.context_layout, documents=documents)
        assert (layout.a2a_size, layout.ring_size) == ((1, world) if comm == "p2p" else (world, 1)), layout
        local = shard_batch(batch, [cu], 0, 1, pstate.cp_rank, world, layout)
        assert local.input_ids.shape[1] == S // world
        rows[name] = (model, optimizer, pstate, local)
    del reference_state

    timer = _StepTimer(dist.barrier)
    steps = {name: [] for name in rows}
    for step in range(spec["warmup"] + spec["steps"]):
        for name, (model, optimizer, pstate, local) in rows.items():
            seconds[:] = 0.0, 0.0
            timer.start()
            result = train_step(model, optimizer, [local], pstate, cpu.accelerator, clip_grad=None)
            wall, cpu_s = timer.stop()
            steps[name].append({"wall_s": wall, "cpu_s": cpu_s, "attention_s": seconds[0],
                                "attention_cpu_s": seconds[1], "loss": float(result.loss),
                                "grad_norm": float(result.grad_norm), "timed": step >= spec["warmup"]})
        if rank == 0:
            print(f"step {step}: " + ", ".join(f"{n} {s[-1]['wall_s']:.2f} s" for n, s in steps.items()), flush=True)
    _write_json(work / f"{tag}.rank{rank}.json", {"side": "ours", "rank": rank, "rows": steps,
                                                  "kernel": rows[BASELINE][0].layers[0].self_attn.backend.kernel.name})
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)


# --- report --------------------------------------------------------------------------------------


def _row_summary(per_rank_steps: list[list[dict]], pairs: list[float] | None) -> dict:
    timed = [i for i, s in enumerate(per_rank_steps[0]) if s["timed"]]
    walls = [per_rank_steps[0][i]["wall_s"] for i in timed]
    def per_rank(key):
        return [statistics.median(steps[i][key] for i in timed) for steps in per_rank_steps]

    attention, attention_cpu, cpu = per_rank("attention_s"), per_rank("attention_cpu_s"), per_rank("cpu_s")
    first = per_rank_steps[0][0]
    out = {"median_s": statistics.median(walls), "min_s": min(walls), "step_times_s": walls,
           "cpu_s_per_rank": cpu, "cpu_s_max": max(cpu),
           "attention_s_per_rank": attention, "attention_s_max": max(attention),
           "attention_s_mean": statistics.mean(attention), "attention_cpu_s_per_rank": attention_cpu,
           "attention_cpu_s_max": max(attention_cpu), "attention_cpu_s_mean": statistics.mean(attention_cpu),
           "first_loss": first["loss"],
           "first_grad_norm": first["grad_norm"], "losses": [s["loss"] for s in per_rank_steps[0]]}
    if pairs is not None:
        out["pairs_per_rank"] = pairs
        out["pairs_max_over_mean"] = max(pairs) / statistics.mean(pairs)
    return out


def summarize(ours: list[dict], peer: list[dict] | None, prepared: dict, args) -> dict:
    rows = {name: _row_summary([r["rows"][name] for r in ours], prepared["pairs_per_rank"][name]) for name in ROWS}
    if peer is not None:
        rows[PEER] = _row_summary(
            [[{"attention_s": float("nan"), "attention_cpu_s": float("nan"), **s} for s in r["steps"]] for r in peer],
            prepared["pairs_per_rank"]["ulysses (a2a)"])
        rows[PEER]["checks"] = peer[0]["checks"]
    base = rows[BASELINE]["median_s"]
    for row in rows.values():
        row["vs_ring_sequence"] = row["median_s"] / base
        if peer is not None:
            row["vs_alst"] = row["median_s"] / rows[PEER]["median_s"]
    losses = [rows[name]["first_loss"] for name in ROWS]
    return {"rows": rows, "first_loss_spread": max(losses) - min(losses),
            "setup": {**{k: getattr(args, k) for k in ("seq_length", "world", "warmup", "steps", "lr", "scale_from",
                                                       "layers", "hidden", "heads", "kv_heads", "vocab")},
                      **{k: v for k, v in prepared.items() if k != "pairs_per_rank"}, "kernel": ours[0]["kernel"]}}


def print_report(r: dict) -> None:
    s = r["setup"]
    print(f"\npacked training step (forward + backward + AdamW; full recompute, MLP tiles {s['mlp_tiles']}, loss tiles "
          f"{s['loss_tiles']}), LLaMA {s['parameters']:,} parameters ({s['layers']} layers, hidden {s['hidden']}, "
          f"{s['heads']}/{s['kv_heads']} heads, vocab {s['vocab']}, fp32), one sample of {s['seq_length']:,} tokens: "
          f"{s['documents']} documents (median {s['median_document']:,}, longest {s['longest_document']:,}, padding "
          f"{s['padding_tokens']}), within-document pairs {s['pairs_share_of_causal']:.2%} of a causal attention over "
          f"the sample; {s['world']} gloo ranks, cp {s['world']}; kernel {s['kernel']}; median of {s['steps']} steps "
          f"after {s['warmup']} warm-up")
    has_peer = PEER in r["rows"]
    print("| layout | step (s) | / ring, sequence |" + (" / ALST |" if has_peer else "") +
          " step CPU s, slowest rank | attention s per rank, max / mean | attention CPU s per rank, max / mean "
          "| attention pairs max / mean | first loss | first grad norm |")
    print("| --- | ---: | ---: |" + (" ---: |" if has_peer else "") + " ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, x in r["rows"].items():
        peer_col = f" {x['vs_alst']:.3f} |" if has_peer else ""
        att, att_cpu = ("-" if math.isnan(x[f"{k}_max"]) else f"{x[f'{k}_max']:.2f} / {x[f'{k}_mean']:.2f}"
                        for k in ("attention_s", "attention_cpu_s"))
        print(f"| {name} | {x['median_s']:.2f} | {x['vs_ring_sequence']:.3f} |{peer_col} {x['cpu_s_max']:.2f} | {att} | "
              f"{att_cpu} | "
              f"{x['pairs_max_over_mean']:.3f} | {x['first_loss']:.6f} | {x['first_grad_norm']:.6f} |")
    print(f"\nour rows' first losses agree within {r['first_loss_spread']:.2e}")
    if has_peer:
        print(f"ALST's attention: {r['rows'][PEER]['checks'].get('peer_attention', '?')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-python", default=None,
                        help="interpreter with deepspeed + transformers for the ALST row (default: no ALST row)")
    parser.add_argument("--seq-length", type=int, default=65536, help="tokens of the packed sample")
    parser.add_argument("--scale-from", type=int, default=1_048_576,
                        help="the mix's lengths are multiplied by --seq-length / this (its shape at that length)")
    parser.add_argument("--documents", type=int, default=20_000, help="documents drawn from the mix before packing")
    parser.add_argument("--world", type=int, default=4, help="gloo processes = context-parallel size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss-tol", type=float, default=1e-5, help="allowed spread of our rows' first losses")
    parser.add_argument("--launch-timeout", type=float, default=3600, help="seconds per launch")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the weights, tokens and logs here")
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    add_worker_flags(parser, ("ours",))
    args = parser.parse_args(argv)
    if args._worker == "prepare":
        prepare(args._work)
        return 0
    if args._worker == "ours":
        ours_worker(args._work, args._tag)
        return 0
    if args.seq_length % (2 * args.world):
        parser.error(f"--seq-length {args.seq_length} is not divisible by 2 x --world {args.world} (the ring's chunks)")

    with tempfile.TemporaryDirectory(prefix="bench_packed_sft_") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        spec = {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                "kv_heads": args.kv_heads, "ffn": 4 * args.hidden, "seq_length": args.seq_length, "world": args.world,
                "warmup": args.warmup, "steps": args.steps, "lr": args.lr, "seed": args.seed,
                "scale_from": args.scale_from, "documents": args.documents, "padding": True, "mlp_tiles": None,
                "loss_tiles": None, "peer_loss": "fused", "packed": True}
        _write_json(work / "spec.json", spec)
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_worker", "prepare", "--_work", str(work)],
                       check=True)
        prepared = json.loads((work / "prepared.json").read_text())
        start = time.perf_counter()
        ours = launch(sys.executable, "ours", work, "ours", args.world, args.launch_timeout,
                      script=Path(__file__).resolve())
        print(f"ours: {time.perf_counter() - start:.0f} s", flush=True)
        peer = None
        if args.peer_python:
            start = time.perf_counter()
            peer = launch(args.peer_python, "peer", work, "peer", args.world, args.launch_timeout)
            print(f"ALST: {time.perf_counter() - start:.0f} s, losses "
                  f"{', '.join('%.6f' % s['loss'] for s in peer[0]['steps'])}", flush=True)
    report = summarize(ours, peer, prepared, args)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if report["first_loss_spread"] > args.loss_tol:
        raise SystemExit(f"our rows' first losses differ by {report['first_loss_spread']:.2e} > --loss-tol "
                         f"{args.loss_tol}: a layout computes another function")
    return 0


if __name__ == "__main__":
    sys.exit(main())
