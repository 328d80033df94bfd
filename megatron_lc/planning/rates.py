"""A machine's rates for the time model: kernel-level figures with their sources (`RATES`), or this machine's
measured (`planning/calibration.py`). Every seconds figure derived from them is a prediction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_lc.devices import PEAK_DENSE_BF16_FLOPS


FA2_BACKWARD_WORK = 2.5
"""Attention backward FLOPs over forward FLOPs: five matmuls against two (flash-attention 2 and 3)."""


@dataclass(frozen=True)
class Rates:
    """What one GPU (or this machine's one process) sustains, with the source of each figure."""

    name: str
    gemm_flops: float
    """Dense 16-bit GEMM FLOP/s sustained (fp32 on `local`)."""
    attention_fwd_flops: dict
    """Causal attention forward FLOP/s by kernel family (fa2, fa3, efficient, cpu)."""
    attention_bwd_flops: dict
    hbm_bytes: float
    """Device memory bandwidth (the optimizer step is bound by it)."""
    host_copy_bytes: float
    """Host <-> device copy bandwidth per GPU and direction."""
    intra_node_bytes: float
    """Bytes per second one GPU sends in an all-to-all or ring step inside a node."""
    inter_node_bytes: float
    """Bytes per second one GPU sends to another node."""
    launch_s: float
    """Fixed cost of one tile, stage or collective in one pass (launches, latency)."""
    peak_flops: float
    """The dense peak MFU is measured against."""
    sources: dict = field(default_factory=dict)
    cores_per_process: float = 1.0
    """`local` only: the share of the measured core(s) each process gets."""
    causal_overhead_tokens: dict = field(default_factory=dict)
    """By kernel family: c in rate(T) = rate / (1 + c / T) for a causal call of T tokens (the diagonal tiles' cost;
    0 when absent: the rates are already the causal ones at the measured length)."""
    host_adam_params: float = 0.0
    """Parameters per second one GPU's process updates in the host's AdamW step with clipping
    (--optimizer-cpu-offload; the host's memory bandwidth bounds it), running `host_adam_threads` threads."""
    host_adam_threads: int = 0
    """Threads of one process that `host_adam_params` assumes: the node's cores over its processes, as the trainer
    sets them for the host step (`parallel_state.host_threads_per_process`)."""
    segment_s: dict = field(default_factory=dict)
    """By kernel family: (forward, backward) seconds one document segment costs beyond its FLOPs, for a kernel that
    runs one call per segment (the CPU's flash kernel has no variable-length entry point); absent: one launch takes
    every segment (flash-attn varlen and the GPU kernels), nothing per segment."""
    collectives_overlap: bool = True
    """Collectives run beside the compute (NCCL on its own streams, the copy engines). False on `local`: FSDP2
    issues its all-gathers and reduce-scatters with async_op=False, which gloo runs to the end on the calling
    thread, and gloo's own threads copy the ring's and all-to-alls' bytes on the cores the compute needs."""

    def attention_rates(self, family: str, call_tokens: int) -> tuple[float, float]:
        """(forward, backward) FLOP/s of a causal call of `call_tokens` tokens."""
        c = self.causal_overhead_tokens.get(family, 0.0)
        factor = 1.0 / (1.0 + c / max(call_tokens, 1))
        return self.attention_fwd_flops[family] * factor, self.attention_bwd_flops[family] * factor

    def scaled(self, share: float) -> "Rates":
        """Rates of a process that gets `share` of the compute it was measured with (oversubscribed cores)."""
        s = min(1.0, share)
        return dataclasses.replace(self, gemm_flops=self.gemm_flops * s,
                                   attention_fwd_flops={k: v * s for k, v in self.attention_fwd_flops.items()},
                                   attention_bwd_flops={k: v * s for k, v in self.attention_bwd_flops.items()},
                                   hbm_bytes=self.hbm_bytes * s, host_copy_bytes=self.host_copy_bytes * s,
                                   host_adam_params=self.host_adam_params * s,
                                   segment_s={k: (f / s, b / s) for k, (f, b) in self.segment_s.items()})


_H100_PEAK = PEAK_DENSE_BF16_FLOPS["H100"][0]
_H100_GEMM = 795e12
"""Dense bf16 GEMM FLOP/s an H100 SXM sustains at the best shapes (the maximum achievable matmul FLOPS measured in
stas00/ml-engineering's MAMF table); the step's GEMMs are [S/cp, 4096] x [4096, n] at S/cp >= 16K tokens."""
_GEMM_EFFICIENCY = _H100_GEMM / _H100_PEAK
"""Share of the dense peak large bf16 GEMMs sustain (A100: the same share, an assumption)."""
HOST_ADAM_BYTES_PER_PARAMETER = 96
"""Host memory traffic of one parameter's step in torch's foreach AdamW on CPU with clipping: 21 fp32 reads and
writes over its passes (weight decay, lerp, mul, addcmul, sqrt, div, add, addcdiv: counted from
torch/optim/adam.py `_multi_tensor_adam`), 3 for the norm and the clip."""
_DGX_H100_HOST_BYTES = 0.7 * 2 * 8 * 38.4e9
"""Two Xeon Platinum 8480C (DGX H100 datasheet), 8 channels of DDR5-4800 each (Intel ark: 38.4 GB/s a channel):
614 GB/s a node, 70% of it sustained (assumed, STREAM-like)."""
_H100_SOURCES = {
    "peak_flops": "989.4 TFLOP/s dense BF16, NVIDIA H100 SXM5 datasheet",
    "gemm_flops": "795 TFLOP/s: maximum achievable matmul FLOPS of an H100 SXM, stas00/ml-engineering's MAMF table",
    "attention": "FlashAttention-3 paper (arXiv 2407.08608), H100 SXM5, bf16, head dim 128, at 16K tokens: forward "
                 "non-causal FA2 370 / FA3 648 TFLOP/s, causal 335 / 616; backward non-causal FA2 322 / FA3 561 "
                 "(the paper's figures); a causal call of T tokens runs at the non-causal rate / (1 + c / T), c fitted "
                 "to the forward's causal/non-causal ratio at 16K (FA2 1,712, FA3 851 tokens: the diagonal tiles' "
                 "share), applied to the backward too (an assumption); torch's memory-efficient kernel at half of FA2 "
                 "(assumed)",
    "hbm_bytes": "3.35 TB/s HBM3, NVIDIA H100 SXM5 datasheet",
    "host_copy_bytes": "PCIe Gen5 x16: 64 GB/s per direction (PCI-SIG), 50 GB/s sustained (assumed)",
    "intra_node_bytes": "320 GB/s: NCCL all-to-all bus bandwidth on 8 x H100 NVLink 4 (nccl-tests, NVIDIA GTC25 "
                        "S72583, as reproduced in stas00/ml-engineering)",
    "inter_node_bytes": "48 GB/s: NCCL all-to-all bus bandwidth across DGX H100 nodes with 8 x 400 Gb/s RDMA "
                        "(same source)",
    "launch_s": "20 us per tile, stage or collective and pass (assumed)",
    "host_adam_params": "DGX H100: 2 x Xeon Platinum 8480C (DGX H100 datasheet), 8 channels of DDR5-4800 each "
                        "(Intel ark), 614 GB/s a node, 70% sustained (assumed), shared by 8 processes of 14 threads "
                        "each (the node's 112 cores over its processes, as the trainer sets them; one thread moves "
                        "about 6 GB/s in this step, measured on a CPU, so 14 reach the bandwidth share), over the "
                        f"{HOST_ADAM_BYTES_PER_PARAMETER} B a parameter's host AdamW step and clip moves",
    "nccl_sm_share": "not priced: NCCL's kernels take SMs from an attention they overlap (no published figure "
                     "for this pairing that we know of)",
}
_H100 = Rates("dgx-h100", _H100_GEMM, {"fa2": 370e12, "fa3": 648e12, "efficient": 185e12},
              {"fa2": 322e12, "fa3": 561e12, "efficient": 161e12}, 3.35e12, 50e9, 320e9, 48e9, 20e-6,
              _H100_PEAK, _H100_SOURCES, causal_overhead_tokens={"fa2": 1712.0, "fa3": 851.0, "efficient": 1712.0},
              host_adam_params=_DGX_H100_HOST_BYTES / 8 / HOST_ADAM_BYTES_PER_PARAMETER, host_adam_threads=112 // 8)
RATES = {
    "dgx-h100": _H100,
    "dgx-h200": dataclasses.replace(_H100, name="dgx-h200", hbm_bytes=4.8e12, sources={
        **_H100_SOURCES, "hbm_bytes": "4.8 TB/s HBM3e, NVIDIA H200 datasheet (compute as H100 SXM5)"}),
    "dgx-a100-80gb": Rates(
        "dgx-a100-80gb", _GEMM_EFFICIENCY * PEAK_DENSE_BF16_FLOPS["A100"][0], {"fa2": 190e12, "efficient": 95e12},
        {"fa2": 150e12, "efficient": 75e12}, 2.039e12, 25e9, 0.7 * 300e9, 0.8 * 25e9, 20e-6, PEAK_DENSE_BF16_FLOPS["A100"][0], {
            "peak_flops": "312 TFLOP/s dense BF16, NVIDIA A100 datasheet",
            "gemm_flops": "the H100's MAMF share of its peak (80%), assumed",
            "attention": "flash-attention 2 about 190 / 150 TFLOP/s forward / backward on A100 (FlashAttention-2 "
                         "paper, arXiv 2307.08691, read off its figures); no FA3 before sm90",
            "hbm_bytes": "2.039 TB/s, NVIDIA A100 80GB SXM datasheet",
            "host_copy_bytes": "PCIe Gen4 x16: 32 GB/s per direction, 25 GB/s sustained (assumed)",
            "intra_node_bytes": "NVLink 3: 300 GB/s per direction per GPU (NVIDIA), 70% (assumed)",
            "inter_node_bytes": "200 Gb/s HDR per GPU (DGX A100 datasheet), 80% (assumed)",
            "host_adam_params": "DGX A100: 2 x AMD EPYC 7742 (DGX A100 datasheet), 8 channels of DDR4-3200 each "
                                "(AMD), 410 GB/s a node, 70% sustained (assumed), shared by 8 processes of 16 "
                                "threads each (the node's 128 cores over its processes)"},
        host_adam_params=0.7 * 2 * 8 * 25.6e9 / 8 / HOST_ADAM_BYTES_PER_PARAMETER, host_adam_threads=128 // 8),
}
