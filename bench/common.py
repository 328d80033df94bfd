"""Shared pieces of the benchmarks: a small long-context model, batches, gloo process launch."""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lc.data.samples import MockSamples
from megatron_lc.data.loader import collate
from megatron_lc.devices import Devices
from megatron_lc.entry import exit_process
from megatron_lc.models.llama import get_config

CPU = Devices(torch.device("cpu"), torch.device("cpu"))


def bench_model_config(layers: int = 4, hidden: int = 256, heads: int = 8, kv_heads: int = 2,
                       vocab: int = 16000):
    """A small LLaMA whose activations, MLP and logits are in realistic proportion at long length."""
    return dataclasses.replace(get_config("debug"), num_layers=layers, hidden_size=hidden,
                               num_attention_heads=heads, num_query_groups=kv_heads,
                               kv_channels=hidden // heads, ffn_hidden_size=4 * hidden, vocab_size=vocab)


def batch_for(config, seq_length: int, cp_rank: int = 0, cp: int = 1, seed: int = 0):
    samples = MockSamples(config.vocab_size, seq_length, seed)
    return collate([samples.get(0, cp_rank, cp)], seq_length)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, args, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = fn(rank, world, *args)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()
    exit_process(0)  # the interpreter's teardown can abort on gloo's threads


def run_ranks(fn, world: int, *args):
    """fn(rank, world, *args) in `world` gloo processes; returns rank 0's result."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(fn, world, _free_port(), args, queue), nprocs=world, join=True,
                       start_method="spawn")
    return queue.get()


def time_alternately(runs: dict, warmup: int, steps: int) -> dict:
    """Time a training step (forward + backward) of each run, `runs` name -> (model, pstate, batch), the runs
    alternated step by step so that load changes hit every one alike; called on every rank.

    Returns per run the wall seconds and all ranks' CPU seconds of each timed step (CPU seconds are
    insensitive to other jobs' load), and the last loss."""
    from megatron_lc.training.step import forward_backward

    times, cpu_times, losses = {name: [] for name in runs}, {name: [] for name in runs}, {}
    for step in range(warmup + steps):
        for name, (model, pstate, batch) in runs.items():
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            result = forward_backward(model, [batch], pstate, CPU.accelerator)
            cpu_seconds = torch.tensor(time.process_time() - cpu_start)
            dist.barrier()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
                dist.all_reduce(cpu_seconds)
                cpu_times[name].append(float(cpu_seconds))
            losses[name] = float(result.loss)
            model.zero_grad(set_to_none=True)
    return {"times": times, "cpu_times": cpu_times, "losses": losses}
