"""This machine's rates, measured once (`--machine local`): GEMMs and attention at the configuration's own
shapes, host copies, the host optimizer step and gloo all-to-alls, cached per machine and thread count."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_lc.config import RunSpec, TrainConfig
from megatron_lc.planning.rates import FA2_BACKWARD_WORK, Rates



LOCAL_CACHE = Path.home() / ".cache" / "megatron_lc" / "local_rates.json"
MEASURED = {"gemm_flops", "attention_fwd_flops", "attention_bwd_flops", "copy_bytes", "a2a_bytes", "launch_s",
            "host_adam_params", "segment_fwd_s", "segment_bwd_s"}
"""What a calibration measures (a cached one without all of it is measured again)."""


@dataclass(frozen=True)
class CalibrationShapes:
    """The shapes a configuration's step runs at, capped so that a calibration takes seconds: a CPU's rates
    depend on them (a 2048 x 512 x 2048 GEMM and a 4096-token attention run at different rates)."""

    tokens: int = 2048
    """Rows of every GEMM: a micro-batch's tokens on one rank (capped at 8,192)."""
    hidden: int = 512
    ffn: int = 2048
    vocab: int = 2048
    qkv: int = 768
    """Columns of the fused q/k/v projection: (heads + 2 kv heads) x head dim."""
    attention_width: int = 512
    """Rows of the output projection: heads x head dim."""
    attention_tokens: int = 2048
    """Tokens one attention call sees (a whole sample, or a ring chunk; capped at 4,096)."""
    heads: int = 4
    """Heads one rank attends (all, over the all-to-all size)."""
    head_dim: int = 64

    @staticmethod
    def of(cfg: TrainConfig, spec: RunSpec) -> "CalibrationShapes":
        """The shapes of `cfg`'s step (`spec`: its run spec)."""
        c, layout = spec.model, spec.parallelize.cp.layout
        S, cp = cfg.data.seq_length, spec.dims.cp
        return CalibrationShapes(
            tokens=min(cfg.data.micro_batch_size * S // cp, 8192), hidden=c.hidden_size, ffn=c.ffn_hidden_size,
            vocab=c.vocab_size, qkv=(c.num_attention_heads + 2 * c.num_query_groups) * c.kv_channels,
            attention_width=c.num_attention_heads * c.kv_channels,
            attention_tokens=min(S // layout.ring_size, 4096),
            heads=max(1, c.num_attention_heads // layout.a2a_size), head_dim=c.kv_channels)

    def key(self) -> str:
        return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


def calibrate_local(threads: int = 1, cache: Path | None = LOCAL_CACHE, processes: int = 1,
                    refresh: bool = False, shapes: CalibrationShapes = CalibrationShapes()) -> Rates:
    """This machine's rates at `shapes` for one process of `threads` threads, measured once (seconds) and cached.

    `processes` running at once share the machine's cores: each gets cores / (processes x threads)
    of what one measured (at most all of it)."""
    import torch

    from megatron_lc.parallel_state import host_threads_per_process  # torch: imported when measuring

    cores = os.cpu_count() or 1
    # the host step's threads, as the trainer sets them for `processes` on this node
    host_threads = host_threads_per_process({"LOCAL_WORLD_SIZE": str(processes)})
    exchanging = max(2, min(processes, 8))  # gloo's rate a process sees falls as more processes share the cores
    key = (f"threads={threads} host_threads={host_threads} exchanging={exchanging} torch={torch.__version__} "
           f"{shapes.key()}")
    measured = None if refresh else _read_cache(cache, key)
    if measured is None or not MEASURED <= measured.keys():  # an older calibration measured less
        measured = _measure_local(threads, shapes, host_threads, exchanging)
        _write_cache(cache, key, measured)
    rates = Rates("local", measured["gemm_flops"], {"cpu": measured["attention_fwd_flops"]},
                  {"cpu": measured["attention_bwd_flops"]}, measured["copy_bytes"], measured["copy_bytes"],
                  measured["a2a_bytes"], measured["a2a_bytes"], measured["launch_s"], measured["gemm_flops"],
                  {"all": f"measured on this machine ({key}), cached in {cache}"},
                  host_adam_params=measured["host_adam_params"], host_adam_threads=host_threads,
                  segment_s={"cpu": (measured["segment_fwd_s"], measured["segment_bwd_s"])}, collectives_overlap=False)
    # The host step was measured at its own share of the cores already.
    return dataclasses.replace(rates.scaled(cores / (processes * threads)), host_adam_params=rates.host_adam_params)


def _read_cache(cache: Path | None, key: str) -> dict | None:
    if cache is None or not cache.exists():
        return None
    try:
        return json.loads(cache.read_text()).get(key)
    except (OSError, ValueError):
        return None


def _write_cache(cache: Path | None, key: str, measured: dict) -> None:
    if cache is None:
        return
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(cache.read_text()) if cache.exists() else {}
        cache.write_text(json.dumps({**old, key: measured}, indent=1))
    except (OSError, ValueError):
        pass  # a cache that cannot be written only costs the next run a calibration


def _best_time(fn, repeats: int = 5) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


COPY_BYTES = 64 << 20
"""Bytes of the calibration's memory copy: past the caches, so that it measures the memory's bandwidth."""


def copy_operands(nbytes: int = COPY_BYTES):
    """Source and destination fp32 tensors of `nbytes` each for the bandwidth measurement."""
    import torch

    src = torch.randn(nbytes // 4)
    return src, torch.empty_like(src)


def _measure_local(threads: int, shapes: CalibrationShapes, host_threads: int = 1, exchanging: int = 2) -> dict:
    """GEMM (a layer's projections, MLP and the output head at the step's shapes), CPU flash attention,
    copy and in-process exchange rates of this machine at `threads` threads; the host optimizer's step at
    `host_threads`; gloo's all-to-all among `exchanging` processes."""
    import torch

    from megatron_lc.attention.kernels import KERNELS

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        T, h = shapes.tokens, shapes.hidden
        products = [(h, shapes.qkv), (shapes.attention_width, h), (h, shapes.ffn), (h, shapes.ffn),
                    (shapes.ffn, h), (h, shapes.vocab)]  # q/k/v, o, gate, up, down, output head
        operands = [(torch.randn(T, k), torch.randn(k, n)) for k, n in products]
        flops = sum(2 * T * k * n for k, n in products)
        gemm = flops / _best_time(lambda: [torch.mm(a, b) for a, b in operands], repeats=3)
        S, H, d = shapes.attention_tokens, shapes.heads, shapes.head_dim
        q, k, v = (torch.randn(S, H, d) for _ in range(3))
        kernel, cu = KERNELS["cpu_flash"], (0, S)
        out, lse, state = kernel.forward(q, k, v, cu)
        attention = 2 * S * S * d * H
        fwd = attention / _best_time(lambda: kernel.forward(q, k, v, cu), repeats=3)
        bwd = FA2_BACKWARD_WORK * attention / _best_time(
            lambda: kernel.backward(out, q, k, v, out, lse, cu, state=state), repeats=3)
        segment_fwd, segment_bwd = _segment_seconds(kernel, H, d)
        src, dst = copy_operands()
        copy = src.numel() * src.element_size() / _best_time(lambda: dst.copy_(src))
        small = torch.randn(8)
        launch = _best_time(lambda: [small.add(1) for _ in range(1000)]) / 1000
        torch.set_num_threads(host_threads)
        host_adam = _measure_host_adam()
    finally:
        torch.set_num_threads(old)
    return {"gemm_flops": gemm, "attention_fwd_flops": fwd, "attention_bwd_flops": bwd, "copy_bytes": copy,
            "a2a_bytes": _measure_gloo_all_to_all(threads, exchanging), "launch_s": launch, "host_adam_params": host_adam,
            "segment_fwd_s": segment_fwd, "segment_bwd_s": segment_bwd}


SEGMENT_TOKENS, SEGMENTS = 4, 64
"""The calibration's segments: so short that their FLOPs are nothing beside what each call costs."""


def _segment_seconds(kernel, heads: int, head_dim: int) -> tuple[float, float]:
    """Forward and backward seconds of one document segment in a call of many tiny ones: what a kernel that runs
    one call per segment pays per segment beyond its FLOPs."""
    import torch

    n = SEGMENT_TOKENS * SEGMENTS
    q, k, v = (torch.randn(n, heads, head_dim) for _ in range(3))
    cu = tuple(range(0, n + 1, SEGMENT_TOKENS))
    out, lse, state = kernel.forward(q, k, v, cu)
    fwd = _best_time(lambda: kernel.forward(q, k, v, cu), repeats=3) / SEGMENTS
    bwd = _best_time(lambda: kernel.backward(out, q, k, v, out, lse, cu, state=state), repeats=3) / SEGMENTS
    return fwd, bwd


def _measure_host_adam(numel: int = COPY_BYTES // 4) -> float:
    """Parameters per second of the host optimizer's step on this machine: torch's foreach AdamW with the global
    norm and clip, as HostAdamW runs them, over parameters past the caches."""
    import torch

    params = [torch.randn(numel // 4) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    adam = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True)

    def step():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm, foreach=True)
        adam.step()
    return sum(p.numel() for p in params) / _best_time(step, repeats=3)


def _measure_gloo_all_to_all(threads: int, processes: int = 2, nbytes: int = 8 << 20) -> float:
    """Bytes per second one of `processes` gloo processes on this machine sends in all_to_all_single, all of them
    exchanging at once."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:  # a free port for the processes
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rate"
        mp.start_processes(_gloo_worker, args=(processes, free_port, threads, nbytes, str(out)), nprocs=processes,
                           start_method="spawn")
        return float(out.read_text())


def _gloo_worker(rank: int, world: int, port: int, threads: int, nbytes: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        send = torch.randn(nbytes // 4)
        recv = torch.empty_like(send)
        seconds = _best_time(lambda: dist.all_to_all_single(recv, send), repeats=3)
        if rank == 0:
            Path(out).write_text(str(nbytes * (world - 1) / world / seconds))
    finally:
        dist.destroy_process_group()
