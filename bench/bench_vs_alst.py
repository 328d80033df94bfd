#!/usr/bin/env python3
"""One training step of ours against DeepSpeed's ALST, side by side on CPU: same model, same tokens.

    python bench/bench_vs_alst.py --peer-python /tmp/dsvenv/bin/python --rounds 2
    python bench/bench_vs_alst.py --peer-python /tmp/dsvenv/bin/python --seq-length 4096 --json

The peer side (ALST: Arctic Long Sequence Training) needs DeepSpeed and transformers, which this
project does not depend on: install them in some venv (`pip install deepspeed transformers`, with a
CPU torch) and point the bench at that interpreter with `--peer-python /path/to/venv/bin/python`
(default: this interpreter). Only the peer's worker imports deepspeed, and only through its public
API. The peer runs with `DS_ACCELERATOR=cpu` (gloo) unless the environment sets it.

Both sides (`--world` = 4 gloo processes, sequence/context parallel size 4, fp32, micro batch 1):
    - the same LLaMA (hidden 256, 3 layers, 8 heads, 4 kv heads, head dim 32, ffn 1024, vocab 32000,
      untied: 19,334,912 parameters; each side's count is printed and asserted equal), initialised by
      `build_model(config, device='cpu', seed=0)` and handed to the peer through the project's own
      transformers conversion (`megatron_lc.models.llama.hf`: `to_hf_config`, `to_hf_state_dict`) as a
      safetensors directory that the peer loads with `LlamaForCausalLM.from_pretrained(...,
      attn_implementation='sdpa')`;
    - the same tokens: one sample of `--seq-length` random ids (`megatron_lc.testing.make_batch`, seed 0, one
      document, labels = the next token, every label valid), attended causally over the whole sample;
    - a full training step: forward, backward and torch's AdamW (`--lr`, betas 0.9/0.95, eps 1e-8, no
      weight decay, no gradient clipping), the same tokens every step;
    - the same tile counts: MLP tiles and loss tiles from the project's chunk planner
      (`megatron_lc.memory.chunks.plan_chunks`), whose defaults are ALST's rules (ceil(local tokens /
      hidden) MLP tiles, loss tiles of at most 1 GiB of fp32 logits); `--mlp-tiles` / `--loss-tiles`
      set both sides.

Ours: FSDP2 + Ulysses cp=4 + full recompute + tiled MLP + tiled loss, `parallelize_llama` with
    `ParallelizeOptions(cp_impl='ulysses', recompute_granularity='full', mlp_tiles, loss_tiles)`, the step
    `megatron_lc.training.step.train_step` (forward_backward, global grad norm, AdamW step, zero_grad).
Peer: ZeRO-3 (`deepspeed.initialize`, optimizer AdamW with `torch_adam`) + Ulysses SP 4
    (`UlyssesSPAttentionHF.register_with_transformers(core_attn_implementation='sdpa', ...)`) +
    `gradient_checkpointing_enable()` + `TiledMLP` patched into `LlamaMLP.forward` (as DeepSpeed's
    tutorial shows) + the tiled loss of ArcticTraining's SFT trainer: `model.model(...)` for the hidden
    states, `TiledFusedLogitsLoss` over `lm_head` + HF's `loss_function` on the rank's shard, combined
    over the sp group by the tutorial's differentiable weighted all_gather (`--peer-loss sequence-tiled`:
    `sequence_tiled_compute`, as in DeepSpeed's tutorial, instead); `engine.backward`, `engine.step`.
    The sequence is sharded as `UlyssesSPDataLoaderAdapter` does: labels shifted before sharding
    (from the sample's S + 1 tokens, so the last token keeps its real label as on our side), then
    input_ids, position_ids and shift_labels cut into contiguous chunks.

bench/bench_packed_sft.py runs the peer worker on a packed sample (`"packed"` in the spec): position ids restart
in every document, and the core attention under DeepSpeed's Ulysses is `PACKED_ATTENTION` (sdpa per document, from
the gathered position ids, as the flash cores do on a GPU) instead of `sdpa` (causal over the whole sample).

The optimizer is `torch.optim.AdamW` on both sides: ours from `build_optimizer` (foreach, over the FSDP2
shards), the peer's from DeepSpeed's `"torch_adam": true` (over ZeRO-3's flat fp32 partition).

Each side checks at run time that it does what it claims (ours: the options and every block's
recompute / tile settings, the Ulysses backend, FSDP parameters; the peer: the ulysses wrapper in
`ALL_ATTENTION_FUNCTIONS['sdpa']`, ZeRO stage 3 with partitioned parameters, sp size 4, checkpointing on
every decoder layer, torch AdamW) and, every step, that attention and the MLP ran twice per layer
(forward + recompute) and the MLP through its tiled autograd function.

Measured per side, in alternated launches (ours, peer, ours, peer, ... `--rounds` of each, every launch
`--warmup` + `--steps` steps, each side in its own 4 processes so its peak RSS is its own): wall
seconds of each step (barrier before and after), all ranks' CPU seconds, the loss (the first steps'
losses must agree within `--loss-tol`), the global gradient norm, the peak RSS of every rank
(`getrusage(RUSAGE_SELF).ru_maxrss` at the end of the launch; the launcher is a small process without
torch, so the peak Linux carries over from it across fork + exec is a few MiB), and on rank 0 a
breakdown of the step (forward incl. the loss, backward, optimizer). Reported: medians, ratios
ours / peer, a markdown table, and `--json`. `--profile` adds one untimed step under torch.profiler on
rank 0 of each side's first launch and prints its top ops.

Worth knowing when reading the results:
    - TiledFusedLogitsLoss computes lm_head's weight gradient inside its forward with an assumed upstream
      gradient of 1 and scales only the hidden-state gradient by the real one in backward. In
      ArcticTraining's loss (the tiled sum, divided by the tokens, then the weighted sp all_gather) the
      real upstream gradient is not 1, so the peer's lm_head.weight gradient comes out (local tokens)
      times too large; the "first grad norm" column shows it (measured at 1024 tokens: lm_head 127.909 on
      the peer against 0.4996 on ours, = x256, the other parameters' gradients alike). AdamW is invariant
      to a constant scale of one tensor's gradient up to eps, so the losses still follow ours. With
      `--peer-loss sequence-tiled` the gradients agree (grad norm 1.754092 against ours 1.754057 at
      1024 tokens, every parameter's gradient within 1e-6 relative; the 2e-5 is our reported norm:
      torch's fp32 `_foreach_norm` on CPU, the double precision norm of our gradients is 1.754092).
    - `from_pretrained` returns the model in eval mode, where HF skips checkpointing: the peer calls
      `model.train()` (dropout is 0, nothing else changes); the per-step call counts would catch it.
    - ZeRO-3's default `stage3_param_persistence_threshold` (1e5 elements) keeps the attention
      projections and the norms unpartitioned on the peer; FSDP2 shards every parameter on ours.
    - DeepSpeed's CPU accelerator builds its shm comm op when a launch starts (setup, not timed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDES = ("ours", "peer")
IGNORE_INDEX = -100


# --- shared by both workers (stdlib only at import time) -------------------------------------------


def _rss_kib() -> dict:
    """Peak RSS (getrusage, KiB) and the kernel's VmHWM / VmRSS of this process."""
    import resource

    out = {"ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0])
    return out


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


class _StepTimer:
    """Wall and CPU seconds of a step between barriers, and marks inside it (rank-local)."""

    def __init__(self, barrier):
        self.barrier = barrier
        self.marks = {}

    def start(self):
        self.barrier()
        self.marks = {}
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def mark(self, name):
        self.marks[name] = time.perf_counter() - self.t0

    def stop(self):
        cpu = time.process_time() - self.c0
        self.barrier()
        return time.perf_counter() - self.t0, cpu


def _profiled_step(work: Path, tag: str, rank: int, step, barrier, rows: int = 20) -> None:
    """One more (untimed) step, under torch.profiler on rank 0: its ops by self CPU time to work/TAG.profile.txt."""
    from torch.profiler import ProfilerActivity, profile

    barrier()
    if rank != 0:
        step()
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    (work / f"{tag}.profile.txt").write_text(table)


# --- prepare: weights, HF directory, tokens (project interpreter) ----------------------------------


def our_config(spec):
    from megatron_lc.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"], num_layers=spec["layers"],
                       num_attention_heads=spec["heads"], num_query_groups=spec["kv_heads"],
                       kv_channels=spec["hidden"] // spec["heads"], ffn_hidden_size=spec["ffn"])


def write_peer_weights(work: Path, spec: dict):
    """Our model of `spec` (seed 0) and work/hf, the same weights for the peer (the project's conversion)."""
    import torch

    from megatron_lc.models.llama import build_model
    from megatron_lc.models.llama.hf import to_hf_config, to_hf_state_dict
    from megatron_lc.training.hf_conversion import save_safetensors

    config = our_config(spec)
    model = build_model(config, device="cpu", seed=0)
    hf = work / "hf"
    hf.mkdir()
    to_hf_config(config, torch_dtype=torch.float32).save_pretrained(hf)
    save_safetensors({k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), config).items()},
                     hf / "model.safetensors")
    return config, model


def prepare(work: Path) -> None:
    """Writes work/hf (the peer's weights, via the project's conversion), work/tokens.pt, work/prepared.json."""
    import torch

    sys.path.insert(0, str(REPO))
    from megatron_lc.memory.chunks import plan_chunks
    from megatron_lc.models.llama import count_parameters
    from megatron_lc.testing import make_batch

    spec = json.loads((work / "spec.json").read_text())
    config, model = write_peer_weights(work, spec)
    batch, _ = make_batch(1, spec["seq_length"], config.vocab_size, seed=spec["seed"], num_docs=1)
    assert batch.cu_seqlens == (0, spec["seq_length"]) and bool((batch.labels != IGNORE_INDEX).all())
    torch.save({"input_ids": batch.input_ids, "labels": batch.labels, "position_ids": batch.position_ids},
               work / "tokens.pt")
    local = spec["seq_length"] // spec["world"]
    plan = plan_chunks(local, config.hidden_size, config.ffn_hidden_size, config.vocab_size, 4,
                       mlp_tiles=spec["mlp_tiles"], loss_tiles=spec["loss_tiles"])
    _write_json(work / "prepared.json", {"parameters": count_parameters(model), "mlp_tiles": plan.mlp_tiles,
                                         "loss_tiles": plan.loss_tiles, "local_tokens": local})


# --- ours ----------------------------------------------------------------------------------------


def ours_worker(work: Path, tag: str, profile: bool) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from megatron_lc.attention.ulysses import UlyssesAttention
    from megatron_lc.attention.context_parallel import ContextParallel
    from megatron_lc.devices import Devices
    from megatron_lc.entry import exit_process
    from megatron_lc.memory.stack import MemoryStack
    from megatron_lc.models.llama import build_model, count_parameters
    from megatron_lc.models.llama.parallelize import (
        ParallelizeOptions,
        materialize,
        parallelize_llama,
    )
    from megatron_lc.parallel_state import ParallelDims, ParallelState
    from megatron_lc.training.optim import build_optimizer
    from megatron_lc.training.step import train_step
    from megatron_lc.testing import Batch, shard_batch

    spec = json.loads((work / "spec.json").read_text())
    prepared = json.loads((work / "prepared.json").read_text())
    cpu = Devices(torch.device("cpu"), torch.device("cpu"))
    config = our_config(spec)
    pstate = ParallelState(ParallelDims(world_size=world, cp=world))
    opts = ParallelizeOptions(cp=ContextParallel(impl="ulysses"), seq_length=spec["seq_length"], memory=MemoryStack(
        recompute_granularity="full", mlp_tiles=prepared["mlp_tiles"], loss_tiles=prepared["loss_tiles"],
        keep_attention_output=spec["ours_keep_attention_output"]))
    reference_state = build_model(config, device="cpu", seed=0).state_dict()
    model = build_model(config, device="meta")
    parameters = count_parameters(model)
    parallelize_llama(model, pstate, opts, cpu)
    materialize(model, cpu)
    set_model_state_dict(model, reference_state, options=StateDictOptions(full_state_dict=True))
    del reference_state
    optimizer = build_optimizer(model, lr=spec["lr"], weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)

    # The stack is what it claims to be.
    assert (opts.cp.impl, opts.memory.recompute_granularity, opts.memory.recompute_layers) == ("ulysses", "full", None), opts
    assert opts.memory.mlp_tiles >= 1 and opts.memory.loss_tiles >= 1 and not opts.memory.offloads, opts
    assert pstate.cp_size == world == spec["world"] and isinstance(model, FSDPModule)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    for layer in model.layers:
        assert isinstance(layer, FSDPModule) and layer.memory.recompute == "full", layer.memory
        assert layer.memory.keep_attention == spec["ours_keep_attention_output"], layer.memory
        assert layer.mlp.num_tiles == opts.mlp_tiles and isinstance(layer.self_attn.backend, UlyssesAttention)
    assert model.head.loss_tiles == opts.loss_tiles and torch.get_num_threads() == 1

    full = torch.load(work / "tokens.pt")
    batch = Batch(full["input_ids"], full["labels"], full["position_ids"], (0, spec["seq_length"]))
    local = shard_batch(batch, [(0, spec["seq_length"])], 0, 1, pstate.cp_rank, world)
    chunk = spec["seq_length"] // world
    assert torch.equal(local.input_ids, full["input_ids"][:, rank * chunk:(rank + 1) * chunk])  # contiguous, as ALST

    timer = _StepTimer(dist.barrier)
    calls = {"attention": 0, "mlp": 0}
    mlp_grad_fns = set()

    def count(name):
        def hook(module, args, output):
            calls[name] += 1
            if name == "mlp" and output.grad_fn is not None:
                mlp_grad_fns.add(type(output.grad_fn).__name__)
        return hook

    for layer in model.layers:
        layer.self_attn.register_forward_hook(count("attention"))
        layer.mlp.register_forward_hook(count("mlp"))
    model.register_forward_pre_hook(lambda *_: timer.mark("forward_start"))
    model.head.register_forward_pre_hook(lambda *_: timer.mark("head_start"))
    model.head.register_forward_hook(lambda *_: timer.mark("head_end"))
    model.register_forward_hook(lambda *_: timer.mark("forward_end"))
    optimizer.register_step_pre_hook(lambda *_: timer.mark("optimizer_start"))
    optimizer.register_step_post_hook(lambda *_: timer.mark("optimizer_end"))

    setup_rss = _rss_kib()
    steps = []
    for step in range(spec["warmup"] + spec["steps"]):
        calls.update(attention=0, mlp=0)
        timer.start()
        result = train_step(model, optimizer, [local], pstate, cpu.accelerator, clip_grad=None)
        wall, cpu_s = timer.stop()
        m = timer.marks
        assert calls == {"attention": 2 * config.num_layers, "mlp": 2 * config.num_layers}, calls
        steps.append({"wall_s": wall, "cpu_s": cpu_s, "loss": float(result.loss), "grad_norm": float(result.grad_norm),
                      "timed": step >= spec["warmup"],
                      "phases": {"forward": m["forward_end"] - m["forward_start"],
                                 "forward_model": m["head_start"] - m["forward_start"],
                                 "loss": m["head_end"] - m["head_start"],
                                 "backward": m["optimizer_start"] - m["forward_end"],
                                 "optimizer": m["optimizer_end"] - m["optimizer_start"],
                                 "other": wall - (m["optimizer_end"] - m["forward_start"])}})
    assert mlp_grad_fns == {"_TiledSwiGLUBackward"}, mlp_grad_fns
    rss = _rss_kib()  # before the profiled step, if any
    if profile:
        _profiled_step(work, tag, rank, lambda: train_step(model, optimizer, [local], pstate, cpu.accelerator,
                                                           clip_grad=None), dist.barrier)
    _write_json(work / f"{tag}.rank{rank}.json", {
        "side": "ours", "rank": rank, "parameters": parameters, "steps": steps, "setup_rss": setup_rss,
        "rss": rss, "checks": {"mlp_grad_fns": sorted(mlp_grad_fns), "calls_per_step": calls,
                                      "options": {k: str(v) for k, v in vars(opts).items()}}})
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)


# --- peer: DeepSpeed ALST (peer interpreter; deepspeed is imported here only) ------------------------

PACKED_ATTENTION = "sdpa_documents"
"""The peer's core attention on packed samples (bench/bench_packed_sft.py), registered with transformers'
AttentionInterface: DeepSpeed's Ulysses discards attention masks and hands its core attention the sample's
position ids gathered over the sp group; only its flash-attention cores (CUDA) turn them into documents, and on
`sdpa` or `flex_attention` it attends causally over the whole sample, across documents. This core does on CPU what
the flash varlen path does on a GPU: the documents start where the gathered position ids are 0, and torch's sdpa
runs causally over each document alone."""


def _packed_sdpa_attention(seconds: list):
    """The `PACKED_ATTENTION` core: attention per document (from the gathered position ids), adding its wall seconds
    to seconds[0] and this thread's CPU seconds to seconds[1]: its forward (recompute included) directly, its
    backward between two autograd markers (the gradient reaching its output and leaving its inputs; a CPU backward
    runs on the calling thread)."""
    import torch
    import torch.nn.functional as F

    class BackwardStarts(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out):
            return out.view_as(out)

        @staticmethod
        def backward(ctx, grad):
            seconds[2:] = time.perf_counter(), time.thread_time()
            return grad

    class BackwardEnds(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return q.view_as(q), k.view_as(k), v.view_as(v)

        @staticmethod
        def backward(ctx, gq, gk, gv):
            seconds[0] += time.perf_counter() - seconds[2]
            seconds[1] += time.thread_time() - seconds[3]
            return gq, gk, gv

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        assert attention_mask is None and dropout == 0.0, "the packed core takes no mask and no dropout"
        start, cpu_start = time.perf_counter(), time.thread_time()
        positions = kwargs["position_ids"]
        assert positions.shape[0] == 1 and positions.shape[1] == query.shape[2], positions.shape
        bounds = [*torch.nonzero(positions[0] == 0).flatten().tolist(), query.shape[2]]
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        query, key, value = BackwardEnds.apply(query, key, value)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        # split, not slices: its backward writes each input's gradient once, where a slice's would zero-fill a
        # whole input-sized gradient per document
        out = torch.cat([F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
                         for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)))], dim=2)
        out = BackwardStarts.apply(out)
        seconds[0] += time.perf_counter() - start
        seconds[1] += time.thread_time() - cpu_start
        return out.transpose(1, 2).contiguous(), None

    return attention


def peer_worker(work: Path, tag: str, profile: bool) -> None:
    import warnings

    import deepspeed
    import deepspeed.comm as ds_dist
    import torch
    import torch.distributed.nn.functional as dist_nn
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledFusedLogitsLoss,
        TiledMLP,
        UlyssesSPAttentionHF,
        sequence_tiled_compute,
    )
    from deepspeed.utils import groups

    spec = json.loads((work / "spec.json").read_text())
    prepared = json.loads((work / "prepared.json").read_text())
    backend = get_accelerator().communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend)
    torch.set_num_threads(1)
    rank, world = ds_dist.get_rank(), ds_dist.get_world_size()
    sp = spec["world"]

    import transformers
    from transformers import AttentionInterface, LlamaForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # Packed samples (bench/bench_packed_sft.py): position ids restart in every document, attention per document.
    packed = spec.get("packed", False)
    attn_impl = PACKED_ATTENTION if packed else "sdpa"
    attention_seconds = [0.0, 0.0, 0.0, 0.0]  # wall, CPU; the backward's start
    if packed:
        AttentionInterface.register(PACKED_ATTENTION, _packed_sdpa_attention(attention_seconds))
    from transformers.models.llama import modeling_llama

    # TiledMLP into LlamaMLP.forward, before the model is built (DeepSpeed's tutorial). The shard count is
    # the run's (both sides alike); ALST's rule ceil(seqlen / hidden) when --mlp-tiles is not given.
    mlp_shards = prepared["mlp_tiles"]
    calls = {"attention": 0, "mlp": 0}
    mlp_grad_fns = set()

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_mlp_forward(self, x):
        # Counted on entry: in a checkpointed layer's recompute, torch's non-reentrant checkpoint stops (raises)
        # once TiledMLP.apply has run and saved its input, so this function does not return there.
        calls["mlp"] += 1
        compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        out = TiledMLP.apply(mlp_forward, self, x, mlp_shards, compute_params)
        if out.grad_fn is not None:
            mlp_grad_fns.add(type(out.grad_fn).__name__)
        return out

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    model, info = LlamaForCausalLM.from_pretrained(work / "hf", attn_implementation=attn_impl, dtype=torch.float32,
                                                   output_loading_info=True)
    assert not any(info.values()), info  # every weight came from the directory
    model.train()  # from_pretrained returns the model in eval mode, where HF skips activation checkpointing
    parameters = sum(p.numel() for p in model.parameters())
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attn_impl, sequence_parallel_size=sp, micro_batch_size=1,
        seq_length=spec["seq_length"], seq_length_is_variable=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it activation_checkpointing_enable
        model.gradient_checkpointing_enable()
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": sp,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 0.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                           mpu=mpu)
    torch.set_num_threads(1)
    hf_model = engine.module
    sp_group = groups._get_sequence_parallel_group()
    sp_rank, sp_world = groups._get_sequence_parallel_rank(), groups._get_sequence_parallel_world_size()

    # The stack is what it claims to be.
    wrapper = ALL_ATTENTION_FUNCTIONS[attn_impl]
    uattn = [c.cell_contents for c in (wrapper.__closure__ or ()) if isinstance(c.cell_contents, UlyssesSPAttentionHF)]
    assert len(uattn) == 1 and "uattn_wrapper" in wrapper.__qualname__, wrapper
    uattn = uattn[0]
    assert uattn.world_size == sp and uattn.global_seq_length == spec["seq_length"] and not uattn.seq_length_is_variable
    uattn.register_forward_hook(lambda *_: calls.__setitem__("attention", calls["attention"] + 1))
    assert hf_model.config._attn_implementation == attn_impl
    assert engine.zero_optimization_stage() == 3 and all(hasattr(p, "ds_id") for p in hf_model.parameters())
    assert sp_world == sp == world and engine.sequence_parallel_size == sp
    decoder_layers = hf_model.model.layers
    assert hf_model.training and all(layer.training and layer.gradient_checkpointing for layer in decoder_layers)
    assert all(type(layer.mlp).forward is tiled_mlp_forward for layer in decoder_layers)
    assert type(engine.optimizer.optimizer) is torch.optim.AdamW, type(engine.optimizer.optimizer)
    assert torch.get_num_threads() == 1

    # Shard as UlyssesSPDataLoaderAdapter does: labels shifted before sharding, contiguous chunks.
    full = torch.load(work / "tokens.pt")
    chunk = spec["seq_length"] // sp
    cut = slice(chunk * sp_rank, chunk * (sp_rank + 1))
    input_ids, position_ids = full["input_ids"][:, cut], full["position_ids"][:, cut]
    shift_labels = full["labels"][:, cut].contiguous()  # labels = the next token of the S + 1 sampled ids
    loss_shards = prepared["loss_tiles"]
    vocab = hf_model.config.vocab_size

    def fused_logits_loss_fn(model_with_head, hidden_states, shift_labels):  # ArcticTraining's SFT loss
        logits = model_with_head.lm_head(hidden_states)
        good_items = (shift_labels != IGNORE_INDEX).sum()
        loss = model_with_head.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=shift_labels)
        return loss * good_items

    def one_step():
        hidden = hf_model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        timer.mark("model_end")
        if spec["peer_loss"] == "fused":  # ArcticTraining's: gradients computed in forward
            total_loss_sum = TiledFusedLogitsLoss.apply(fused_logits_loss_fn, hf_model, hidden, shift_labels, None,
                                                        loss_shards, [hf_model.lm_head.weight], "sum")
        else:  # the DeepSpeed tutorial's: forward under no_grad, recomputed tile by tile in backward
            total_loss_sum = sequence_tiled_compute(
                fused_logits_loss_fn, shift_labels.shape[1], loss_shards,
                {"hidden_states": hidden, "shift_labels": shift_labels}, {"model_with_head": hf_model},
                "hidden_states", compute_params=[hf_model.lm_head.weight], output_unshard_dimension=0,
                output_reduction="sum")
        good = (shift_labels != IGNORE_INDEX).sum()
        loss = total_loss_sum / max(good, 1)
        # the tutorial's differentiable weighted per-shard-loss aggregation across ranks
        losses_per_rank = dist_nn.all_gather(loss, group=sp_group)
        good_per_rank = dist_nn.all_gather(good, group=sp_group)
        total_loss = sum(losses_per_rank[r] * good_per_rank[r] for r in range(sp_world))
        loss = total_loss / max(sum(good_per_rank), 1)
        timer.mark("loss_end")
        engine.backward(loss)
        timer.mark("backward_end")
        engine.step()
        timer.mark("step_end")
        return loss

    timer = _StepTimer(ds_dist.barrier)
    setup_rss = _rss_kib()
    steps = []
    for step in range(spec["warmup"] + spec["steps"]):
        calls.update(attention=0, mlp=0)
        attention_seconds[:2] = 0.0, 0.0
        timer.start()
        loss = one_step()
        wall, cpu_s = timer.stop()
        m = timer.marks
        assert calls == {"attention": 2 * len(decoder_layers), "mlp": 2 * len(decoder_layers)}, calls
        steps.append({"wall_s": wall, "cpu_s": cpu_s, "loss": float(loss), "grad_norm": float(engine.get_global_grad_norm()),
                      "timed": step >= spec["warmup"], **({"attention_s": attention_seconds[0], "attention_cpu_s": attention_seconds[1]} if packed else {}),
                      "phases": {"forward": m["loss_end"], "forward_model": m["model_end"],
                                 "loss": m["loss_end"] - m["model_end"], "backward": m["backward_end"] - m["loss_end"],
                                 "optimizer": m["step_end"] - m["backward_end"], "other": wall - m["step_end"]}})
    assert mlp_grad_fns == {"TiledMLPBackward"}, mlp_grad_fns
    rss = _rss_kib()  # before the profiled step, if any
    if profile:
        _profiled_step(work, tag, rank, one_step, ds_dist.barrier)
    _write_json(work / f"{tag}.rank{rank}.json", {
        "side": "peer", "rank": rank, "parameters": parameters, "steps": steps, "setup_rss": setup_rss,
        "rss": rss, "checks": {"backend": backend, "mlp_grad_fns": sorted(mlp_grad_fns),
                                      "calls_per_step": calls, "attention": wrapper.__qualname__,
                                      "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                                      "zero_stage": engine.zero_optimization_stage(), "sp": sp_world,
                                      "peer_attention": (f"{PACKED_ATTENTION}: torch sdpa, causal, document by document (the documents from the "
                                                         "position ids DeepSpeed gathers)") if packed else
                                      "sdpa, causal over the sample"}})
    ds_dist.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown


# --- launcher ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_worker_flags(parser: argparse.ArgumentParser, sides: tuple[str, ...]) -> None:
    """The hidden flags a bench's own processes run with: `launch`'s workers (`--_worker side --_work --_tag
    [--_profile]`) and the `prepare` step (`--_worker prepare --_work`)."""
    parser.add_argument("--_worker", choices=(*sides, "prepare"), help=argparse.SUPPRESS)
    parser.add_argument("--_work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--_tag", help=argparse.SUPPRESS)
    parser.add_argument("--_profile", action="store_true", help=argparse.SUPPRESS)


def launch(python: str, side: str, work: Path, tag: str, world: int, timeout: float, profile: bool = False,
           script: Path | None = None) -> list[dict]:
    """`world` processes of `side` (rank env as torchrun sets it), started from this small process; their results.
    `script` (default this one) is the bench whose `--_worker side` runs in them."""
    port = _free_port()
    with contextlib.ExitStack() as logs:
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            if side == "peer":
                env.setdefault("DS_ACCELERATOR", "cpu")
            log = logs.enter_context(open(work / f"{tag}.rank{rank}.log", "w"))
            cmd = [python, str(script or Path(__file__).resolve()), "--_worker", side, "--_work", str(work), "--_tag", tag]
            cmd += ["--_profile"] if profile else []
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline, failed = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs) and failed is None:
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if time.monotonic() > deadline:
                failed = "timeout"
            time.sleep(0.2)
        for p in procs:  # a failed rank leaves the others waiting in a collective
            if p.poll() is None:
                p.kill()
            p.wait()
    if failed is None:
        failed = next((r for r, p in enumerate(procs) if p.returncode != 0), None)
    if failed is not None:
        rank = 0 if failed == "timeout" else failed
        tail = (work / f"{tag}.rank{rank}.log").read_text()[-6000:]
        raise RuntimeError(f"{side} launch {tag} failed ({'timeout' if failed == 'timeout' else f'rank {rank}'}):\n{tail}")
    return [json.loads((work / f"{tag}.rank{r}.json").read_text()) for r in range(world)]


def summarize(launches: dict, prepared: dict, args) -> dict:
    out = {}
    for side, runs in launches.items():
        timed = [(i, s) for ranks in runs for i, s in enumerate(ranks[0]["steps"]) if s["timed"]]
        walls = [s["wall_s"] for _, s in timed]
        cpus = [sum(ranks[r]["steps"][i]["cpu_s"] for r in range(len(ranks)))
                for ranks in runs for i, s in enumerate(ranks[0]["steps"]) if s["timed"]]
        first = [ranks[0]["steps"][0] for ranks in runs]
        second = [ranks[0]["steps"][1] for ranks in runs if len(ranks[0]["steps"]) > 1]
        peak = [[ranks[r]["rss"]["ru_maxrss_kib"] / 1024 for r in range(len(ranks))] for ranks in runs]
        setup = [[ranks[r]["setup_rss"]["ru_maxrss_kib"] / 1024 for r in range(len(ranks))] for ranks in runs]
        phases = {k: statistics.median(s["phases"][k] for _, s in timed) for k in timed[0][1]["phases"]}
        out[side] = {
            "parameters": runs[0][0]["parameters"],
            "median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls),
            "cpu_s": statistics.median(cpus), "step_times_s": walls,
            "first_loss": first[0]["loss"], "first_loss_spread": max(f["loss"] for f in first) - min(f["loss"] for f in first),
            "second_loss": second[0]["loss"] if second else None, "first_grad_norm": first[0]["grad_norm"],
            "peak_rss_mib_per_rank": [max(p[r] for p in peak) for r in range(len(peak[0]))],
            "peak_rss_mib_sum": max(sum(p) for p in peak),
            "setup_peak_rss_mib_sum": max(sum(p) for p in setup),
            "rank0_phases_s": phases, "checks": runs[0][0]["checks"],
        }
    ours, peer = out["ours"], out["peer"]
    out["ratio"] = {"median_s": ours["median_s"] / peer["median_s"], "min_s": ours["min_s"] / peer["min_s"],
                    "cpu_s": ours["cpu_s"] / peer["cpu_s"], "peak_rss": ours["peak_rss_mib_sum"] / peer["peak_rss_mib_sum"]}
    out["first_loss_diff"] = abs(ours["first_loss"] - peer["first_loss"])
    out["setup"] = {"seq_length": args.seq_length, "world": args.world, "rounds": args.rounds, "warmup": args.warmup,
                    "steps": args.steps, "lr": args.lr, "peer_loss": args.peer_loss,
                    "ours_keep_attention_output": args.ours_keep_attention_output, **prepared}
    return out


def print_report(r: dict) -> None:
    s, o, p = r["setup"], r["ours"], r["peer"]
    print(f"\nfull training step (forward + backward + AdamW), LLaMA {s['parameters']:,} parameters (3 layers, hidden 256, "
          f"8/4 heads, vocab 32000, fp32), {s['seq_length']} tokens in one sample, {s['world']} gloo ranks, sp/cp "
          f"{s['world']}, {s['local_tokens']} tokens per rank, MLP tiles {s['mlp_tiles']}, loss tiles {s['loss_tiles']}; "
          f"{s['rounds']} alternated launches per side x {s['steps']} timed steps (+{s['warmup']} warm-up); ALST loss: "
          f"{'TiledFusedLogitsLoss' if s['peer_loss'] == 'fused' else 'sequence_tiled_compute'}")
    print("| side | median step (s) | min (s) | max (s) | CPU s, all ranks (median) | peak RSS per rank (MiB) "
          "| peak RSS sum (MiB) | first loss | second loss | first grad norm |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    kept = " + kept attention output" if s["ours_keep_attention_output"] else ""
    for name, label in (("ours", f"ours (FSDP2 + Ulysses + full recompute + tiled MLP/loss{kept})"),
                        ("peer", "ALST (ZeRO-3 + Ulysses SP + checkpointing + TiledMLP + tiled loss)")):
        x = r[name]
        second = "-" if x["second_loss"] is None else f"{x['second_loss']:.6f}"
        print(f"| {label} | {x['median_s']:.2f} | {x['min_s']:.2f} | {x['max_s']:.2f} | {x['cpu_s']:.1f} | "
              f"{' / '.join(f'{v:.0f}' for v in x['peak_rss_mib_per_rank'])} | {x['peak_rss_mib_sum']:.0f} | "
              f"{x['first_loss']:.6f} | {second} | {x['first_grad_norm']:.6f} |")
    q = r["ratio"]
    print(f"| ours / ALST | {q['median_s']:.3f} | {q['min_s']:.3f} | | {q['cpu_s']:.3f} | | {q['peak_rss']:.3f} | "
          f"diff {r['first_loss_diff']:.2e} | | |")
    print("\nrank 0, median seconds per phase")
    print("| side | forward (incl. loss) | backward | optimizer | other |\n| --- | ---: | ---: | ---: | ---: |")
    for name in ("ours", "peer"):
        ph = r[name]["rank0_phases_s"]
        extra = f" (model {ph['forward_model']:.2f} + loss {ph['loss']:.2f})"
        print(f"| {name} | {ph['forward']:.2f}{extra} | {ph['backward']:.2f} | {ph['optimizer']:.2f} | {ph['other']:.2f} |")
    print(f"\nsetup peak RSS sum (before the first step): ours {o['setup_peak_rss_mib_sum']:.0f} MiB, "
          f"ALST {p['setup_peak_rss_mib_sum']:.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-python", default=sys.executable,
                        help="interpreter with deepspeed + transformers for the ALST side (default: this one)")
    parser.add_argument("--seq-length", type=int, default=32768, help="tokens of the one sample")
    parser.add_argument("--world", type=int, default=4, help="gloo processes = sequence/context parallel size")
    parser.add_argument("--rounds", type=int, default=2, help="alternated launches per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per launch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per launch")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (both sides)")
    parser.add_argument("--mlp-tiles", type=int, default=None, help="both sides; default ceil(local tokens / hidden)")
    parser.add_argument("--loss-tiles", type=int, default=None, help="both sides; default: <= 1 GiB fp32 logits a tile")
    parser.add_argument("--peer-loss", choices=("fused", "sequence-tiled"), default="fused",
                        help="ALST's tiled loss: TiledFusedLogitsLoss (ArcticTraining) or sequence_tiled_compute "
                             "(DeepSpeed's tutorial)")
    parser.add_argument("--ours-keep-attention-output", action="store_true",
                        help="ours with --keep-attention-output too: its recompute runs no attention forward")
    parser.add_argument("--seed", type=int, default=0, help="token seed")
    parser.add_argument("--loss-tol", type=float, default=1e-4, help="allowed |first loss ours - ALST|")
    parser.add_argument("--launch-timeout", type=float, default=3600, help="seconds per launch")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the weights, tokens and logs here")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps of each side's first launch, one more step under torch.profiler "
                             "on rank 0; prints its top ops by self CPU time")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    add_worker_flags(parser, SIDES)
    args = parser.parse_args(argv)
    if args._worker == "prepare":
        prepare(args._work)
        return 0
    if args._worker:
        (ours_worker if args._worker == "ours" else peer_worker)(args._work, args._tag, args._profile)
        return 0
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    if args.seq_length % args.world:
        parser.error(f"--seq-length {args.seq_length} is not divisible by --world {args.world}")

    with tempfile.TemporaryDirectory(prefix="bench_vs_alst_") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        spec = {"vocab": 32000, "hidden": 256, "layers": 3, "heads": 8, "kv_heads": 4, "ffn": 1024,
                "seq_length": args.seq_length, "world": args.world, "warmup": args.warmup, "steps": args.steps,
                "lr": args.lr, "seed": args.seed, "peer_loss": args.peer_loss, "mlp_tiles": args.mlp_tiles,
                "loss_tiles": args.loss_tiles, "ours_keep_attention_output": args.ours_keep_attention_output}
        _write_json(work / "spec.json", spec)
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_worker", "prepare", "--_work", str(work)],
                       check=True)
        prepared = json.loads((work / "prepared.json").read_text())
        if args.mlp_tiles is None:
            assert prepared["mlp_tiles"] == math.ceil(prepared["local_tokens"] / spec["hidden"])  # ALST's TiledMLP rule
        if args.loss_tiles is None:  # ArcticTraining's: ceil(fp32 logits GiB of the shard)
            assert prepared["loss_tiles"] == math.ceil(prepared["local_tokens"] * spec["vocab"] * 4 / 2**30)
        launches, profiles = {side: [] for side in SIDES}, {}
        for round_ in range(args.rounds):
            for side in SIDES:
                python = sys.executable if side == "ours" else args.peer_python
                start = time.perf_counter()
                tag, profile = f"{side}{round_}", args.profile and round_ == 0
                launches[side].append(launch(python, side, work, tag, args.world, args.launch_timeout, profile))
                if profile:
                    profiles[side] = (work / f"{tag}.profile.txt").read_text()
                steps = launches[side][-1][0]["steps"]
                walls = ", ".join(f"{s['wall_s']:.2f}" for s in steps)
                losses = ", ".join(f"{s['loss']:.6f}" for s in steps)
                print(f"round {round_ + 1}/{args.rounds} {side}: {time.perf_counter() - start:.0f} s, steps {walls} s, "
                      f"losses {losses}", flush=True)
    report = summarize(launches, prepared, args)
    print(f"parameters: ours {report['ours']['parameters']:,}, ALST {report['peer']['parameters']:,}")
    print_report(report)
    for side, table in profiles.items():
        print(f"\n{side}: rank 0, one profiled step (after the timed ones), ops by self CPU time\n{table}")
    report["profiles"] = profiles
    if args.json:
        print(json.dumps(report, indent=1))
    if report["ours"]["parameters"] != report["peer"]["parameters"]:
        raise SystemExit(f"parameter counts differ: ours {report['ours']['parameters']}, ALST "
                         f"{report['peer']['parameters']}")
    if report["first_loss_diff"] > args.loss_tol:
        raise SystemExit(f"first losses differ by {report['first_loss_diff']:.2e} > --loss-tol {args.loss_tol}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
