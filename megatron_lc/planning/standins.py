"""What the GPU allocates that a CPU trace would not: attention-kernel workspaces and NCCL buffers.

The planner traces the step on fake CPU tensors. Everything our Python code allocates is
traced as it is; what a CUDA kernel or the communication library allocates internally
must be modelled. This module models, for a CUDA target:

Attention kernels (registered in `megatron_lc.attention.kernels.KERNELS` under
`planned:<name>` for the duration of a trace, so every backend selects them through
the registry as it selects the real ones):

- `flash_attn` (flash-attn 2, varlen): forward returns `out` (q's shape and dtype) and
  the fp32 log-sum-exp `[H, T]`. Backward, besides `dq, dk, dv` (allocated by our
  wrapper): the fp32 dq accumulator `[T + 128 b, H, round32(d)]`, the fp32 softmax
  row sums `[H, T + 128 b]` (b: number of segments), and with grouped-query attention
  dk/dv expanded to all q heads `[T, H, d]` (q dtype) before they are summed per kv
  head. All are freed when the kernel returns.
- `sdpa_flash` (torch's flash kernels, one call per segment): our per-segment wrapper
  runs as written (kv heads expanded, outputs copied into place); the CUDA forward and
  backward ops run on their fake implementations, and the backward adds torch's flash
  workspaces: the fp32 dq accumulator `[1, round128(L), H, round32(d)]` and the fp32
  softmax row sums `[1, H, round128(L)]` of each segment, freed when the op returns.

Fused CUDA ops: on CUDA, `F.rms_norm` runs torch's fused kernel (`_fused_rms_norm`),
whose autograd saves the input and an fp32 `rstd` per row and whose backward returns
`grad_input` and `grad_weight`; on CPU it decomposes into pow/mean/rsqrt/mul, each with
a full-size intermediate saved for backward. `cuda_op_models` (open during a CUDA-target
trace) replaces `F.rms_norm` by a stand-in with the fused kernel's
allocations.

Communication library: NCCL allocates its buffers outside PyTorch's allocator, a fixed
amount per communicator (channels x peers x protocol buffers; it does not grow with
the message size). The planner counts the process groups the traced step communicates
on (one communicator each) and adds `nccl_gib_per_communicator` for each.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from megatron_lc.attention import kernels

PLANNED_PREFIX = "planned:"
FLASH_ROW_PAD = 128
"""flash-attn keeps 128 spare rows per segment in its dq accumulator and row sums."""
DEFAULT_NCCL_GIB_PER_COMMUNICATOR = 0.5
"""Assumed NCCL buffers per communicator on an NVLink node (published measurements: 0.5-0.7 GiB)."""

NameBuffer = Callable[[torch.Tensor, str], None]


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def _flash_head_dim(d: int) -> int:
    """flash-attn's rounded head dimension of its fp32 accumulators."""
    return _round_up(d, 32) if d <= 192 else 256


def _flash_varlen_kernel(name: str, name_buffer: NameBuffer) -> kernels.Kernel:
    """flash-attention 2's variable-length forward/backward, allocating what the CUDA kernels allocate.

    flash-attn's `_flash_attn_varlen_*` and torch's `_flash_attention_*` with cum_seq run
    the same kernels with the same workspaces (torch vendors flash-attention 2).
    """

    def forward(q, k, v, cu_seqlens, scale=None):
        kernels._check_flash_dtype(q, name)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        name_buffer(lse, "flash log-sum-exp")
        return out, lse, (torch.empty(2, dtype=torch.int64, device=q.device),)

    def backward(dout, q, k, v, out, lse, cu_seqlens, scale=None, state=()):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        rows, heads, d = q.shape
        padded_rows = rows + FLASH_ROW_PAD * (len(cu_seqlens) - 1)
        workspace = [torch.empty(heads, padded_rows, dtype=torch.float32, device=q.device),
                     torch.empty(padded_rows, heads, _flash_head_dim(d), dtype=torch.float32, device=q.device)]
        name_buffer(workspace[0], "flash bwd softmax row sums (fp32)")
        name_buffer(workspace[1], "flash bwd dq accumulator (fp32)")
        if k.shape[1] != heads:  # GQA: dk, dv for every q head, then summed per kv head
            expanded = [torch.empty(k.shape[0], heads, d, dtype=k.dtype, device=k.device) for _ in range(2)]
            for t in expanded:
                name_buffer(t, "flash bwd dk/dv expanded to q heads")
            torch.sum(expanded[0].unflatten(1, (k.shape[1], -1)), dim=2, out=dk)
            torch.sum(expanded[1].unflatten(1, (k.shape[1], -1)), dim=2, out=dv)
            workspace += expanded
        del workspace
        return dq, dk, dv

    return kernels.Kernel(PLANNED_PREFIX + name, forward, backward)


def _flash_attn_kernel(name_buffer: NameBuffer) -> kernels.Kernel:
    return _flash_varlen_kernel("flash_attn", name_buffer)


def _sdpa_flash_kernel(name_buffer: NameBuffer) -> kernels.Kernel:
    return _flash_varlen_kernel("sdpa_flash", name_buffer)


def _sdpa_efficient_kernel(name_buffer: NameBuffer) -> kernels.Kernel:
    """torch's memory-efficient kernels: our wrapper as written (kv heads expanded, lse re-laid out) on the
    operators' fake implementations, which allocate their outputs; no internal workspace is modelled."""
    real = kernels.KERNELS["sdpa_efficient"]
    return kernels.Kernel(PLANNED_PREFIX + "sdpa_efficient", real.forward, real.backward)


CUDA_KERNEL_MODELS = {"flash_attn": _flash_attn_kernel, "sdpa_flash": _sdpa_flash_kernel,
                      "sdpa_efficient": _sdpa_efficient_kernel}


def planned_kernel_name(kernel: str, device: str, dtype: torch.dtype = torch.bfloat16,
                        flash_attn_installed: bool = False) -> str:
    """The kernel the trace selects: the one the runtime would run (`auto` resolved as
    `select_kernel` resolves it for inputs of `dtype`), as its CUDA stand-in, or the CPU kernel itself."""
    name = kernels.resolve_kernel_name(device, kernel, dtype, flash_attn_installed)
    if device == "cpu":
        if name in CUDA_KERNEL_MODELS:
            raise ValueError(f"--attention-kernel {kernel} needs CUDA; plan with --device cuda")
        return name
    if name not in CUDA_KERNEL_MODELS:
        raise ValueError(f"--attention-kernel {kernel}: the planner models {', '.join(CUDA_KERNEL_MODELS)} on CUDA")
    if name in ("flash_attn", "sdpa_flash") and dtype not in kernels.FLASH_DTYPES:
        raise ValueError(f"--attention-kernel {kernel} takes fp16/bf16 only: add --bf16, or use auto")
    return PLANNED_PREFIX + name


@contextlib.contextmanager
def registered_kernel_models(name_buffer: NameBuffer) -> Iterator[None]:
    """Make the CUDA kernel stand-ins selectable by name while the context is open."""
    added = {PLANNED_PREFIX + name: build(name_buffer) for name, build in CUDA_KERNEL_MODELS.items()}
    kernels.KERNELS.update(added)
    try:
        yield
    finally:
        for name in added:
            kernels.KERNELS.pop(name, None)


class _FusedRMSNorm(torch.autograd.Function):
    """Allocations of torch's fused CUDA RMSNorm: out and fp32 rstd; saves input, rstd, weight."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        kept = x.shape[: x.dim() - len(normalized_shape)]
        rstd = torch.empty(*kept, *([1] * len(normalized_shape)), dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, rstd, weight)
        ctx.has_weight = weight is not None
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad_out):
        x, _rstd, weight = ctx.saved_tensors
        grad_weight = torch.empty_like(weight) if ctx.has_weight and ctx.needs_input_grad[2] else None
        return torch.empty_like(x), None, grad_weight, None


@contextlib.contextmanager
def cuda_op_models() -> Iterator[None]:
    """`F.rms_norm` allocates as torch's fused CUDA kernel while the context is open.

    A function swap rather than a TorchFunctionMode: modes are not active in backward,
    where checkpointed blocks are recomputed.
    """
    original = F.rms_norm
    F.rms_norm = _rms_norm
    try:
        yield
    finally:
        F.rms_norm = original


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    return _FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps)


class BufferNamer:
    """Forwards kernel stand-ins' buffer names to the tracker once it exists (it is built after the model)."""

    def __init__(self) -> None:
        self.tracker = None

    def __call__(self, t: torch.Tensor, name: str) -> None:
        if self.tracker is not None:
            self.tracker.name_buffer(t, name)


def nccl_bytes(num_communicators: int, gib_per_communicator: float) -> int:
    """Modelled NCCL buffer bytes of one rank."""
    return int(num_communicators * gib_per_communicator * (1 << 30))
