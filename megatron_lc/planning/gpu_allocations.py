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
- `sdpa_flash` (torch's flash kernels, varlen): as `flash_attn`, plus torch's contiguous
  copies of a strided `grad_out` and `out` in the backward. Both model one call; the
  wrappers split more than 65,535 segments over several, each with its share of the
  workspace (the model's single workspace is then an upper bound).
- `sdpa_efficient` (torch's memory-efficient kernels): our wrapper runs as written (kv
  heads expanded, lse re-laid out, one call per bucket of consecutive segments), with the
  two operators replaced by their allocations: the forward's out and lse `[segments, H,
  round32(longest)]`; each backward call's dq, dk, dv, delta, for fp32 inputs the fp32
  product `grad_out * out`, and the fp32 dq workspace of
  `efficient_backward_workspace_bytes` (segments x heads x longest x head_dim, in tiles).

Fused CUDA ops: on CUDA, `F.rms_norm` runs torch's fused kernel (`_fused_rms_norm`),
whose autograd saves the input and an fp32 `rstd` per row and whose backward returns
`grad_input` and `grad_weight`; on CPU it decomposes into pow/mean/rsqrt/mul, each with
a full-size intermediate saved for backward. `cuda_rms_norm` is a stand-in with the fused
kernel's allocations; a CUDA-target trace passes it as the model's norm op
(`ParallelizeOptions.rms_norm`).

Communication library: NCCL allocates its buffers outside PyTorch's allocator, per
connection, a fixed amount that does not grow with the message size. `NcclSettings`
models them from the settings a run states (NCCL_BUFFSIZE, channels); see
`communicator_bytes` for the layout and which figures are assumptions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_lc.attention import kernels
from megatron_lc.attention.kernel_selection import resolve_kernel_name
from megatron_lc.attention.varlen import segment_pairs

PLANNED_PREFIX = "planned:"
FLASH_ROW_PAD = 128
"""flash-attn keeps 128 spare rows per segment in its dq accumulator and row sums."""

NameBuffer = Callable[[torch.Tensor, str], None]


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def _flash_head_dim(d: int) -> int:
    """The head dimension of flash-attention 2's backward accumulators (`mha_varlen_bwd`:
    `round_multiple(head_size, head_size <= 128 ? 32 : 64)`)."""
    return _round_up(d, 32 if d <= 128 else 64)


def _varlen_forward(name: str, name_buffer: NameBuffer, lse_name: str) -> Callable:
    """A flash kernel's varlen forward as it allocates: `out` (q's shape and dtype), the fp32 log-sum-exp
    `[H, T]` and the rng state."""

    def forward(q, k, v, cu_seqlens, scale=None, *, cu_seqlens_k=None, causal=True):
        kernels._check_flash_dtype(q, name)
        segment_pairs(cu_seqlens, cu_seqlens_k, causal)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        name_buffer(lse, lse_name)
        return out, lse, (torch.empty(2, dtype=torch.int64, device=q.device),)

    return forward


def _flash_varlen_kernel(name: str, name_buffer: NameBuffer, copies_strided: bool) -> kernels.Kernel:
    """flash-attention 2's variable-length forward/backward, allocating what the CUDA kernels allocate.

    flash-attn's `_flash_attn_varlen_*` and torch's `_flash_attention_*` with cum_seq run
    the same kernels with the same workspaces (torch vendors flash-attention 2). One
    difference: torch's backward makes `grad_out` and `out` contiguous (`.contiguous()` in
    `attention_backward.cu`), where flash-attn copies only a last dimension that is not
    (`copies_strided`): Untied Ulysses hands both in as views of its receive buffer.
    """

    forward = _varlen_forward(name, name_buffer, "flash log-sum-exp")

    def backward(dout, q, k, v, out, lse, cu_seqlens, scale=None, state=(), *, cu_seqlens_k=None, causal=True):
        copies = [t.contiguous() for t in (dout, out) if copies_strided and not t.is_contiguous()]
        for t in copies:
            name_buffer(t, "sdpa flash bwd contiguous copy of grad_out/out")
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
        del workspace, copies
        return dq, dk, dv

    return kernels.Kernel(PLANNED_PREFIX + name, forward, backward)


def _flash_attn_kernel(name_buffer: NameBuffer) -> kernels.Kernel:
    return _flash_varlen_kernel("flash_attn", name_buffer, copies_strided=False)


def _sdpa_flash_kernel(name_buffer: NameBuffer) -> kernels.Kernel:
    return _flash_varlen_kernel("sdpa_flash", name_buffer, copies_strided=True)


FA3_BWD_BLOCK_M, FA3_BWD_BLOCK_N = 64, 128
"""FA3's sm90 backward tiles for a causal head_dim of 128 (`hopper/flash_api.cpp`: kBlockM 64, kBlockN 128): its
workspaces pad every segment by a tile."""


def _fa3_head_dim(d: int) -> int:
    """FA3's rounded head dimension (`round_up_headdim`: 64, 96, 128, 192 or 256)."""
    return next(r for r in (64, 96, 128, 192, 256) if d <= r)


def _fa3_varlen_kernel(name_buffer: NameBuffer) -> kernels.Kernel:
    """FlashAttention-3 behind torch's flash operators (`--flash-attention-impl fa3`), allocating what its
    varlen kernels allocate (`hopper/flash_api.cpp`, `mha_fwd`/`mha_bwd`, through torch/nn/attention/_fa3.py).

    Forward: out and an fp32 log-sum-exp `[H, T]` (no split-KV accumulators in training). Backward: dq, dk, dv;
    fp32 `softmax_d` and `softmax_lse_log2` `[H, Tq]`, the fp32 dq accumulator `[H, Tq * d_r]`, and with GQA
    fp32 dk/dv accumulators `[Hkv, Tk, d_r]` (where flash-attention 2 expands dk/dv to every q head in 16 bits),
    Tq = round_up(T + segments * 64, 64), Tk = round_up(T + segments * 128, 128); torch's wrapper copies only a
    last dimension that is not contiguous."""

    forward = _varlen_forward("sdpa_flash", name_buffer, "FA3 log-sum-exp")

    def backward(dout, q, k, v, out, lse, cu_seqlens, scale=None, state=(), *, cu_seqlens_k=None, causal=True):
        rows, heads, d = q.shape
        segments = len(cu_seqlens) - 1
        q_rows = _round_up(rows + segments * FA3_BWD_BLOCK_M, FA3_BWD_BLOCK_M)
        k_rows = _round_up(k.shape[0] + segments * FA3_BWD_BLOCK_N, FA3_BWD_BLOCK_N)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        workspace = [torch.empty(heads, q_rows, dtype=torch.float32, device=q.device) for _ in range(2)]
        workspace.append(torch.empty(heads, q_rows * _fa3_head_dim(d), dtype=torch.float32, device=q.device))
        name_buffer(workspace[0], "FA3 bwd softmax_d (fp32)")
        name_buffer(workspace[1], "FA3 bwd softmax_lse_log2 (fp32)")
        name_buffer(workspace[2], "FA3 bwd dq accumulator (fp32)")
        if k.shape[1] != heads:  # GQA: dk, dv accumulated per kv head in fp32
            accumulators = [torch.zeros(k.shape[1], k_rows, _fa3_head_dim(d), dtype=torch.float32, device=k.device)
                            for _ in range(2)]
            for t in accumulators:
                name_buffer(t, "FA3 bwd dk/dv accumulator (fp32)")
            workspace += accumulators
        del workspace
        return dq, dk, dv

    return kernels.Kernel(PLANNED_PREFIX + "fa3", forward, backward)


EFFICIENT_BWD_TILE = (kernels.EFFICIENT_TILE_ROWS, 64)
"""Rows and columns of the memory-efficient backward's dq tile (`kBlockSizeI`, `kBlockSizeJ`): 128 x 64 (or
128 x 128 over a head_dim of 128, the same bytes), the largest of torch's sm80 kernels (`cutlassB.h`; an
assumption: the kernel torch picks may use 64 x 64 tiles, needing less)."""


def efficient_backward_workspace_bytes(segments: int, heads: int, longest: int, head_dim: int) -> int:
    """Bytes of the fp32 workspace `_efficient_attention_backward` allocates for one call
    (`workspace_size()` in `kernel_backward.h`): per segment and head, a dq accumulator tile of
    (rows x columns) floats plus a 16-byte lock header for every tile of the longest segment x head_dim.
    The dk/dv staging of 16-bit kernels that keep no output in registers is not modelled."""
    rows, cols = EFFICIENT_BWD_TILE
    tiles = math.ceil(longest / rows) * math.ceil(head_dim / cols)
    return segments * heads * tiles * (rows * cols * 4 + 16)


def _efficient_forward_model(query, key, value, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type, lse,
                             *, scale=None):
    """What torch's `_efficient_attention_forward` allocates: out, lse [segments, H, round32(longest)], philox."""
    native = torch.empty(cu_q.shape[0] - 1, query.shape[2], _round_up(max_q, 32), dtype=torch.float32,
                         device=query.device)
    seed, offset = (torch.empty((), dtype=torch.int64, device=query.device) for _ in range(2))
    return torch.empty_like(query), native, seed, offset, max_q, max_k


def _efficient_backward_model(name_buffer: NameBuffer) -> Callable:
    """What one `_efficient_attention_backward` call allocates, in its order (`attention_backward.cu`): dq, dk,
    dv; delta [1, H, T] fp32 (for fp32 inputs computed on the host from a full fp32 product grad_out * out);
    the workspace of `efficient_backward_workspace_bytes`. All but dq, dk, dv are freed when it returns."""

    def backward(grad_out, query, key, value, bias, out, cu_q, cu_k, max_q, max_k, *args, scale=None):
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (query, key, value))
        _, tokens, heads, d = query.shape
        if query.dtype == torch.float32:  # the kernel computes delta itself for 16-bit inputs only
            product = torch.empty(1, tokens, heads, value.shape[-1], dtype=torch.float32, device=query.device)
            name_buffer(product, "memory-efficient bwd grad_out * out (fp32)")
            del product
        delta = torch.empty(1, heads, tokens, dtype=torch.float32, device=query.device)
        workspace = torch.empty(efficient_backward_workspace_bytes(cu_q.shape[0] - 1, heads, max_q, d),
                                dtype=torch.uint8, device=query.device)
        name_buffer(workspace, "memory-efficient bwd dq accumulator (fp32)")
        del workspace, delta
        return (*grads, torch.empty(0, dtype=query.dtype, device=query.device))

    return backward


def _sdpa_efficient_kernel(name_buffer: NameBuffer) -> kernels.Kernel:
    """torch's memory-efficient kernels: our wrapper as written (kv heads expanded, lse re-laid out, one call
    per bucket of segments), given the operators' allocation models in place of the operators (torch's own
    fake implementation of the backward does not take the operator's keyword arguments)."""
    ops = {**kernels.TORCH_OPS, **efficient_op_models(name_buffer)}
    return kernels.Kernel(PLANNED_PREFIX + "sdpa_efficient", functools.partial(kernels.sdpa_efficient_forward, ops=ops),
                          functools.partial(kernels.sdpa_efficient_backward, ops=ops))


def efficient_op_models(name_buffer: NameBuffer) -> dict[str, Callable]:
    """Allocation models of the memory-efficient operators, by their role in `kernels.TORCH_OPS`."""
    return {"efficient_forward": _efficient_forward_model, "efficient_backward": _efficient_backward_model(name_buffer)}


CUDA_KERNEL_MODELS = {"flash_attn": _flash_attn_kernel, "sdpa_flash": _sdpa_flash_kernel,
                      "sdpa_efficient": _sdpa_efficient_kernel, "fa3": _fa3_varlen_kernel}
"""CUDA kernels by what runs: `fa3` is torch's flash operators with FA3 behind them; FA4 is modelled as torch's
own flash kernel (its allocations are not modelled yet)."""


def planned_kernel_name(kernel: str, device: str, dtype: torch.dtype = torch.bfloat16,
                        flash_attn_installed: bool = False, flash_impl: str = "default") -> str:
    """The kernel the trace selects: the one the runtime would run (`auto` resolved as
    `select_kernel` resolves it for inputs of `dtype`, with `flash_impl` behind torch's flash operators), as its
    CUDA stand-in, or the CPU kernel itself."""
    name = resolve_kernel_name(device, kernel, dtype, flash_attn_installed, flash_impl)
    if name == "sdpa_flash" and flash_impl == "fa3" and device != "cpu":
        name = "fa3"
    if device == "cpu":
        if name in CUDA_KERNEL_MODELS:
            raise ValueError(f"--attention-kernel {kernel} needs CUDA; plan with --device cuda")
        return name
    if name not in CUDA_KERNEL_MODELS:
        raise ValueError(f"--attention-kernel {kernel}: the planner models {', '.join(CUDA_KERNEL_MODELS)} on CUDA")
    if name in ("flash_attn", "sdpa_flash", "fa3") and dtype not in kernels.FLASH_DTYPES:
        raise ValueError(f"--attention-kernel {kernel} takes fp16/bf16 only: add --bf16, or use auto")
    return PLANNED_PREFIX + name


def planned_kernels(name_buffer: NameBuffer) -> dict[str, kernels.Kernel]:
    """The kernel table the planner traces with: the real kernels, and each CUDA kernel's stand-in under
    `PLANNED_PREFIX + name` (what `planned_kernel_name` answers)."""
    return {**kernels.KERNELS, **{PLANNED_PREFIX + name: build(name_buffer) for name, build in CUDA_KERNEL_MODELS.items()}}


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


def cuda_rms_norm(input, normalized_shape, weight=None, eps=None):
    """`F.rms_norm` as torch's fused CUDA kernel allocates (the op a CUDA-target trace gives the model's norms:
    an op the model is handed, not a TorchFunctionMode, as modes are not active in backward, where checkpointed
    blocks are recomputed)."""
    return _FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps)


class BufferNamer:
    """Forwards kernel stand-ins' buffer names to the tracker once it exists (it is built after the model)."""

    def __init__(self) -> None:
        self.tracker = None

    def __call__(self, t: torch.Tensor, name: str) -> None:
        if self.tracker is not None:
            self.tracker.name_buffer(t, name)


# --- NCCL buffers ------------------------------------------------------------------------------

NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
"""NCCL's LL protocol buffer per connection: lines per thread x threads x steps x 16-byte lines (512 KiB)."""
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
"""NCCL's LL128 protocol buffer per connection: elements per thread x threads x steps x 8 bytes (4.69 MiB)."""


@dataclass(frozen=True)
class NcclSettings:
    """The NCCL settings buffers are modelled from (the values a recipe exports; NCCL's own where it sets none)."""

    buffsize: int = 4 << 20
    """NCCL_BUFFSIZE: the Simple protocol's buffer per connection (NCCL's default, 4 MiB)."""
    channels: int = 32
    """Ring/tree channels of a communicator (NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS); 32 is an assumption
    for 8 GPUs on NVSwitch."""
    p2p_channels_per_peer: int = 32
    """Channels per peer of point-to-point traffic (all-to-all; NCCL_MAX_P2P_NCHANNELS caps it): 32 is what
    NCCL picks on 8xH100 (NCCL issue #1685)."""
    net_channels_per_peer: int = 2
    """Channels per peer on another node (NCCL_NCHANNELS_PER_NET_PEER, NCCL's default 2)."""
    granularity: int = 2 << 20
    """Allocation granularity of NCCL's cuMem buffers (an assumption: the common 2 MiB)."""


def connection_bytes(s: NcclSettings) -> int:
    """Buffers of one connection, both sides as seen from one rank.

    Our reading of NCCL's P2P transport (an assumption): the receiving side allocates the
    LL, LL128 and Simple buffers in one allocation, and with P2P read the sending side
    also holds a Simple buffer; allocations round up to `granularity`.
    """
    receive = _round_up(NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE + s.buffsize, s.granularity)
    return receive + _round_up(s.buffsize, s.granularity)


def ring_communicator_bytes(ranks: int, s: NcclSettings, on_node: bool) -> int:
    """NCCL buffers of a communicator that carries send/recv to the two ring neighbours only (ring
    attention): per neighbour, `p2p_channels_per_peer` connections on NVLink or `net_channels_per_peer`
    across nodes. NCCL connects on first use, so the ring/tree channels of collectives are not made."""
    if ranks < 2:
        return 0
    neighbours = 1 if ranks == 2 else 2
    per_peer = s.p2p_channels_per_peer if on_node else s.net_channels_per_peer
    return neighbours * per_peer * connection_bytes(s)


def communicator_bytes(ranks: int, all_to_all: bool, s: NcclSettings, ranks_per_node: int = 8) -> int:
    """NCCL buffers one rank holds for one communicator of `ranks` ranks.

    Ring/tree collectives (all-gather, reduce-scatter, all-reduce) connect each rank to its
    neighbours on every channel: `channels` connections. An all-to-all connects every pair
    of ranks: `p2p_channels_per_peer` connections to each peer on the same node,
    `net_channels_per_peer` to each on another (the group is assumed to fill whole nodes of
    `ranks_per_node`; a network connection is assumed to hold what an NVLink one does).
    With the defaults this gives 3.29e9 bytes for the all-to-all connections of an 8-GPU
    communicator; NCCL issue #1685 measured 4.34 - 1.06 = 3.28e9 bytes after the first
    `all_to_all_single` on 8xH100. That one measurement is all the calibration there is.
    """
    if ranks < 2:
        return 0
    local = min(ranks, ranks_per_node) - 1
    peers = local * s.p2p_channels_per_peer + (ranks - 1 - local) * s.net_channels_per_peer if all_to_all else 0
    return (s.channels + peers) * connection_bytes(s)


def nccl_bytes(groups: dict[str, int], all_to_all: tuple[str, ...], s: NcclSettings, ranks_per_node: int = 8,
               point_to_point: tuple[str, ...] = (), ring_on_node: bool = True) -> int:
    """Modelled NCCL buffer bytes of one rank: one communicator per group the step communicates on
    (`point_to_point`: groups that carry only ring send/recv, on one node or across nodes)."""
    return sum(ring_communicator_bytes(ranks, s, ring_on_node) if name in point_to_point and name not in all_to_all
               else communicator_bytes(ranks, name in all_to_all, s, ranks_per_node) for name, ranks in groups.items())
