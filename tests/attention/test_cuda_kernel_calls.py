"""The CUDA kernels' calls into torch's private operators, checked on CPU.

Each operator is replaced by a recording stand-in that checks every argument against
the operator's own schema (`torch.ops.aten.<op>.default._schema`) and against the
kernel's documented input contract (dtypes, shapes, contiguity, defined or undefined
optionals, the tensors the forward returned reaching the backward), then computes the
result in the operator's output layout from materialised-softmax attention. The
wrappers around the operators therefore run end to end and are compared with the
ground truth.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lc.attention import kernels, varlen
from megatron_lc.attention.kernel_selection import resolve_kernel_name, select_kernel
from megatron_lc.attention.kernels import KERNELS

from tests.attention.kernel_contracts import (  # noqa: F401
    CU,
    LONGEST,
    MAX_SEGMENTS,
    FlashRecorder,
    EfficientRecorder,
    _check_schema,
    _check_type,
    _check_cu,
    _same,
    _flash_contract,
    _efficient_contract,
    _naive_segments,
    _naive_grads,
    _qkv,
    _against_naive,
)


@pytest.fixture
def flash(monkeypatch):
    rec = FlashRecorder()
    monkeypatch.setitem(kernels.TORCH_OPS, "flash_forward", rec.forward)
    monkeypatch.setitem(kernels.TORCH_OPS, "flash_backward", rec.backward)
    return rec


@pytest.fixture
def efficient(monkeypatch):
    rec = EfficientRecorder()
    monkeypatch.setitem(kernels.TORCH_OPS, "efficient_forward", rec.forward)
    monkeypatch.setitem(kernels.TORCH_OPS, "efficient_backward", rec.backward)
    return rec


def test_sdpa_flash_is_one_varlen_call_each_way_with_gqa_and_the_forwards_rng_tensors(flash):
    _against_naive(KERNELS["sdpa_flash"], torch.bfloat16, 3e-2)
    assert [name for name, _ in flash.calls] == ["forward", "backward"]
    q = flash.calls[0][1]["query"]
    assert flash.calls[0][1]["key"].shape[1] == 2 and q.shape[1] == 8, "kv heads not repeated"


def test_sdpa_efficient_runs_fp32_through_the_memory_efficient_operator(efficient):
    _against_naive(KERNELS["sdpa_efficient"], torch.float32, 1e-5)
    assert [name for name, _ in efficient.calls] == ["forward", "backward"]


def test_auto_on_cuda_sends_bf16_to_flash_and_fp32_to_memory_efficient(flash, efficient):
    auto = select_kernel(torch.device("cuda"), "auto")  # device type only: nothing runs on a GPU here
    if not kernels.flash_attn_available():
        _against_naive(auto, torch.bfloat16, 3e-2)
        assert len(flash.calls) == 2 and not efficient.calls
    flash.calls.clear()
    _against_naive(auto, torch.float32, 1e-5)
    assert len(efficient.calls) == 2 and not flash.calls


@pytest.mark.parametrize("name", ["sdpa_flash", "flash_attn"])
def test_explicit_flash_kernel_refuses_fp32_naming_the_flag(flash, name):
    q, k, v = _qkv(torch.float32)
    with pytest.raises(TypeError, match="--bf16"):
        KERNELS[name].forward(q, k, v, CU)
    assert not flash.calls


def test_cu_seqlens_tensor_is_built_once_per_micro_batch():
    first = varlen.device_cu_seqlens(CU, torch.device("cpu"))
    assert varlen.device_cu_seqlens(list(CU), torch.device("cpu")) is first
    other = varlen.device_cu_seqlens((0, 128, 256), torch.device("cpu"))
    assert other is not first and other.tolist() == [0, 128, 256]


def test_resolve_kernel_name_matches_select_kernel():
    assert resolve_kernel_name("cuda", "auto", torch.bfloat16, True) == "flash_attn"
    assert resolve_kernel_name("cuda", "auto", torch.bfloat16, False) == "sdpa_flash"
    assert resolve_kernel_name("cuda", "auto", torch.float32, True) == "sdpa_efficient"
    assert resolve_kernel_name("cpu", "auto", torch.float32, False) == select_kernel(torch.device("cpu")).name


def test_flash_attn_version_parsing():
    assert kernels._version_tuple("2.7.4.post1") == (2, 7, 4)
    assert kernels._version_tuple("2.6.3") < kernels.FLASH_ATTN_MIN_VERSION <= kernels._version_tuple("2.7.0")


# --- unmasked attention between different token sets (ring attention's key blocks) --------------

CU_Q, CU_K = (0, 24, 40), (0, 56, 64)


class _ArgumentRecorder:
    """Records the arguments of every call (checked against the schema) and returns zeros of the output layout."""

    def __init__(self, op, outputs, contract=None):
        self.op, self.outputs, self.contract, self.calls = op, outputs, contract, []

    def __call__(self, *args, **kwargs):
        self.calls.append(_check_schema(self.op, args, kwargs))
        if self.contract is not None:
            self.contract(self.calls[-1])
        return self.outputs(self.calls[-1])


def _cross_qkv(dtype):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, h, 16, generator=g).to(dtype) for n, h in ((40, 8), (64, 2), (64, 2))]


def test_flash_kernels_take_separate_query_and_key_boundaries_unmasked(monkeypatch):
    q, k, v = _cross_qkv(torch.bfloat16)
    fwd = _ArgumentRecorder(torch.ops.aten._flash_attention_forward.default, lambda a: (
        torch.zeros_like(a["query"]), torch.zeros(8, 40), torch.empty(2, dtype=torch.int64),
        torch.empty((), dtype=torch.int64), torch.empty(0)), lambda a: _flash_contract(a, backward=False))
    bwd = _ArgumentRecorder(torch.ops.aten._flash_attention_backward.default, lambda a: (
        torch.zeros_like(a["query"]), torch.zeros_like(a["key"]), torch.zeros_like(a["value"])),
        lambda a: _flash_contract(a, backward=True))
    monkeypatch.setitem(kernels.TORCH_OPS, "flash_forward", fwd)
    monkeypatch.setitem(kernels.TORCH_OPS, "flash_backward", bwd)
    out, lse, state = KERNELS["sdpa_flash"].forward(q, k, v, CU_Q, cu_seqlens_k=CU_K, causal=False)
    merged = torch.randn(8, 40)  # ring attention's backward passes the lse merged over key blocks
    KERNELS["sdpa_flash"].backward(out, q, k, v, out, merged, CU_Q, state=state, cu_seqlens_k=CU_K, causal=False)
    for call in (fwd.calls[0], bwd.calls[0]):
        assert tuple(call["cum_seq_q"].tolist()) == CU_Q and tuple(call["cum_seq_k"].tolist()) == CU_K
        assert call["cum_seq_q"].dtype == call["cum_seq_k"].dtype == torch.int32
        assert (call["max_q"], call["max_k"], call["is_causal"]) == (24, 56, False)
    assert _same(bwd.calls[0]["logsumexp"], merged), "the given lse, not a copy"


def test_memory_efficient_kernel_takes_separate_boundaries_and_the_given_lse(monkeypatch):
    q, k, v = _cross_qkv(torch.float32)
    fwd = _ArgumentRecorder(torch.ops.aten._efficient_attention_forward.default, lambda a: (
        torch.zeros_like(a["query"]), torch.zeros(2, 8, 32), torch.empty((), dtype=torch.int64),
        torch.empty((), dtype=torch.int64), 24, 56), lambda a: _efficient_contract(a, backward=False))
    bwd = _ArgumentRecorder(torch.ops.aten._efficient_attention_backward.default, lambda a: (
        torch.zeros_like(a["query"]), torch.zeros_like(a["key"]), torch.zeros_like(a["value"]), torch.empty(0)),
        lambda a: _efficient_contract(a, backward=True))
    monkeypatch.setitem(kernels.TORCH_OPS, "efficient_forward", fwd)
    monkeypatch.setitem(kernels.TORCH_OPS, "efficient_backward", bwd)
    out, lse, state = KERNELS["sdpa_efficient"].forward(q, k, v, CU_Q, cu_seqlens_k=CU_K, causal=False)
    merged = torch.randn(8, 40)
    KERNELS["sdpa_efficient"].backward(out, q, k, v, out, merged, CU_Q, state=state, cu_seqlens_k=CU_K, causal=False)
    for call in (fwd.calls[0], bwd.calls[0]):
        assert tuple(call["cu_seqlens_q"].tolist()) == CU_Q and tuple(call["cu_seqlens_k"].tolist()) == CU_K
        assert (call["max_seqlen_q"], call["max_seqlen_k"], call["custom_mask_type"]) == (24, 56, kernels.NO_MASK)
    native = bwd.calls[0]["logsumexp"]
    assert native.shape == (2, 8, 32)
    assert torch.equal(native[0, :, :24], merged[:, :24]) and torch.equal(native[1, :, :16], merged[:, 24:])


def test_causal_attention_between_different_token_sets_is_refused():
    q, k, v = _cross_qkv(torch.float32)
    for name in ("reference", "cpu_flash", "sdpa_efficient"):
        with pytest.raises(ValueError, match="causal attention takes one cu_seqlens"):
            KERNELS[name].forward(q, k, v, CU_Q, cu_seqlens_k=CU_K)


# --- the operators' contracts with strided inputs, many segments, bounded workspaces -----------------


def _segment_math(q, k, v, cu_q, cu_k, causal, scale):
    """fp64 out [Tq, H, d] and lse [H, Tq] of q [Tq, H, d], k/v [Tk, Hkv, d] over boundary tensors; stays
    differentiable (the backward stand-ins take its gradients)."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    H = q.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(H // k.shape[1], 1), v.double().repeat_interleave(
        H // v.shape[1], 1)
    if cq == ck and varlen.max_seqlen(cq) == 1:  # one-token segments: each query sees only its own key
        return vd, (qd * kd).sum(-1).t() * scale
    outs, lses = [], []
    for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        if b == a:
            continue
        s = torch.einsum("qhd,khd->hqk", qd[a:b], kd[c:d]) * scale
        if causal:
            s = s.masked_fill(torch.ones(b - a, d - c, dtype=torch.bool).triu(1), -math.inf)
        lses.append(torch.logsumexp(s, dim=-1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vd[c:d]))
    return torch.cat(outs), torch.cat(lses, dim=1)


def _segment_grads(dout, q, k, v, cu_q, cu_k, causal, scale):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out, _ = _segment_math(*leaves, cu_q, cu_k, causal, scale)
        out.backward(dout.double())
    return [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def _native_lse(lse, cu):
    """[H, T] -> [segments, H, round32(longest)] padded with +inf, built independently of the kernels module."""
    lengths = cu.diff().long()
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    position = torch.arange(lse.shape[1]) - cu.long()[segment]
    native = torch.full((len(lengths), lse.shape[0], math.ceil(int(lengths.max()) / 32) * 32), math.inf)
    native[segment, :, position] = lse.t().float()
    return native


class ContractOps:
    """Stand-ins for torch's four CUDA operators and flash-attn's varlen interface that check each one's real
    contract (strides included), refuse more segments than a launch takes, and compute their results for
    whatever segmentation each call receives. `calls`: (operator, segments, longest q segment)."""

    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []

    def _record(self, op, cu_q, max_q):
        lengths = cu_q.diff()
        assert max_q == int(lengths.max()), "max_seqlen_q is the call's longest segment"
        self.calls.append((op, cu_q.numel() - 1, max_q))

    def flash_forward(self, *args, **kwargs):
        a = _check_schema(torch.ops.aten._flash_attention_forward.default, args, kwargs)
        _flash_contract(a, backward=False)
        self._record("flash_forward", a["cum_seq_q"], a["max_q"])
        out, lse = _segment_math(a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"], a["is_causal"],
                                 a["scale"])
        return (out.to(a["query"].dtype), lse.float(), torch.empty(2, dtype=torch.int64),
                torch.empty((), dtype=torch.int64), torch.empty(0))

    def flash_backward(self, *args, **kwargs):
        a = _check_schema(torch.ops.aten._flash_attention_backward.default, args, kwargs)
        _flash_contract(a, backward=True)
        self._record("flash_backward", a["cum_seq_q"], a["max_q"])
        grads = _segment_grads(a["grad_out"], a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"],
                               a["is_causal"], a["scale"])
        return tuple(g.to(a["query"].dtype) for g in grads)

    def efficient_forward(self, *args, **kwargs):
        a = _check_schema(torch.ops.aten._efficient_attention_forward.default, args, kwargs)
        _efficient_contract(a, backward=False)
        self._record("efficient_forward", a["cu_seqlens_q"], a["max_seqlen_q"])
        out, lse = _segment_math(a["query"][0], a["key"][0], a["value"][0], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                 a["custom_mask_type"] == 1, a["scale"])
        seed, offset = torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)
        return out.to(a["query"].dtype)[None], _native_lse(lse, a["cu_seqlens_q"]), seed, offset, 0, 0

    def efficient_backward(self, *args, **kwargs):
        a = _check_schema(torch.ops.aten._efficient_attention_backward.default, args, kwargs)
        _efficient_contract(a, backward=True)
        self._record("efficient_backward", a["cu_seqlens_q"], a["max_seqlen_q"])
        q, k, v = a["query"][0], a["key"][0], a["value"][0]
        causal = a["custom_mask_type"] == 1
        _, lse = _segment_math(q, k, v, a["cu_seqlens_q"], a["cu_seqlens_k"], causal, a["scale"])
        torch.testing.assert_close(a["logsumexp"], _native_lse(lse, a["cu_seqlens_q"]), rtol=1e-2, atol=1e-2)
        grads = _segment_grads(a["grad_out_"][0], q, k, v, a["cu_seqlens_q"], a["cu_seqlens_k"], causal, a["scale"])
        return (*(g.to(q.dtype)[None] for g in grads), torch.empty(0))

    def flash_attn_varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal,
                                  **unused):
        for t in (q, k, v):
            assert t.stride(-1) == 1, "flash-attn: contiguous last dimension"
        assert cu_q.numel() - 1 <= MAX_SEGMENTS, "flash-attn: segments go in gridDim.y"
        self._record("flash_attn_forward", cu_q, max_q)
        out, lse = _segment_math(q, k, v, cu_q, cu_k, causal, softmax_scale)
        return out.to(q.dtype), lse.float(), None, torch.empty(2, dtype=torch.int64)

    def flash_attn_varlen_backward(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_q, cu_k, max_q, max_k,
                                   dropout_p, softmax_scale, causal, **unused):
        for t in (dout, q, k, v, out, dq, dk, dv):
            assert t.stride(-1) == 1, "flash-attn: contiguous last dimension"
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert softmax_lse.is_contiguous() and softmax_lse.shape == (q.shape[1], q.shape[0]), "read dense [H, T]"
        assert cu_q.numel() - 1 <= MAX_SEGMENTS, "flash-attn: segments go in gridDim.y"
        self._record("flash_attn_backward", cu_q, max_q)
        for into, grad in zip((dq, dk, dv), _segment_grads(dout, q, k, v, cu_q, cu_k, causal, softmax_scale)):
            into.copy_(grad)


@pytest.fixture
def contract_ops(monkeypatch):
    ops = ContractOps()
    for role in ("flash_forward", "flash_backward", "efficient_forward", "efficient_backward"):
        monkeypatch.setitem(kernels.TORCH_OPS, role, getattr(ops, role))
    interface = type("FlashAttnInterface", (), {})()
    interface._flash_attn_varlen_forward = ops.flash_attn_varlen_forward
    interface._flash_attn_varlen_backward = ops.flash_attn_varlen_backward
    monkeypatch.setattr(kernels, "_flash_attn_interface", interface)
    return ops


def _strided_views(T, H, Hkv, d, dtype, layout, seed=3):
    """q, k, v, an out buffer and dout as strided views: `rows` (heads side by side in one receive buffer,
    rows further apart than H * d) or `elements` (every other element of the last dimension)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "rows":
        wide, narrow = torch.randn(T, 3 * H, d, generator=g), torch.randn(T, 2 * Hkv, d, generator=g)
        wide, narrow = wide.to(dtype), narrow.to(dtype)
        return wide[:, :H], narrow[:, :Hkv], narrow[:, Hkv:], wide[:, H:2 * H], wide[:, 2 * H:]
    views = [torch.randn(T, h, 2 * d, generator=g).to(dtype)[..., ::2] for h in (H, Hkv, Hkv, H, H)]
    return tuple(views)


@pytest.mark.parametrize("layout", ["rows", "elements"])
@pytest.mark.parametrize("name", kernels.CUDA_KERNELS)
def test_every_cuda_kernel_hands_its_operator_strided_views_in_the_operators_layout(contract_ops, name, layout):
    """Untied Ulysses and ring attention pass views of their buffers; in 16-bit the memory-efficient backward
    would misread a strided `out`. Every argument must satisfy its operator's contract; results stay exact."""
    q, k, v, out_buffer, dout = _strided_views(CU[-1], 8, 2, 16, torch.bfloat16, layout)
    kernel = KERNELS[name]
    out, lse, state = kernel.forward(q, k, v, CU)
    out_buffer.copy_(out)  # the backward receives out as a view as well
    dq, dk, dv = kernel.backward(dout, q, k, v, out_buffer, lse, CU, state=state)
    want_out, want_lse = _naive_segments(q, k, v, 1 / 4)
    want = _naive_grads(dout, q, k, v, 1 / 4)
    for got, ref in [(out, want_out), (lse, want_lse), (dq, want[0]), (dk, want[1]), (dv, want[2])]:
        torch.testing.assert_close(got.double(), ref, rtol=3e-2, atol=3e-2)
    assert len(contract_ops.calls) == 2


def _one_token_segments(n, H=2, Hkv=1, d=8):
    g = torch.Generator().manual_seed(4)
    return [torch.randn(n, h, d, generator=g).to(torch.bfloat16) for h in (H, Hkv, Hkv, H)]


@pytest.mark.parametrize("name", kernels.CUDA_KERNELS)
def test_more_segments_than_one_launch_takes_are_split_over_calls(contract_ops, name):
    """70,000 one-token documents: calls of at most 65,535 segments each way, the results written into one
    out, lse, dq, dk, dv (a query that sees only itself: out = v, lse = q.k * scale, dq = dk = 0, dv = dout)."""
    n = 70_000
    q, k, v, dout = _one_token_segments(n)
    cu = tuple(range(n + 1))
    kernel = KERNELS[name]
    out, lse, state = kernel.forward(q, k, v, cu)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, cu, state=state)
    for direction in ("forward", "backward"):
        calls = [segments for op, segments, _ in contract_ops.calls if op.endswith(direction)]
        assert len(calls) > 1 and max(calls) <= MAX_SEGMENTS and sum(calls) == n
        if name != "sdpa_efficient":  # which also bounds its workspace: 128-row tiles for each segment
            assert calls == [MAX_SEGMENTS, n - MAX_SEGMENTS]
    assert torch.equal(out, v.repeat_interleave(2, 1))
    torch.testing.assert_close(lse, (q.double() * k.double()).sum(-1).t().float() / math.sqrt(8))
    assert not dq.any() and not dk.any() and torch.equal(dv, dout.double().sum(1, keepdim=True).to(dv.dtype))


def test_memory_efficient_calls_keep_segments_times_longest_within_twice_the_tokens(contract_ops, monkeypatch):
    """The memory-efficient backward's fp32 dq workspace is segments x heads x longest (in 128-row tiles) x d:
    one call over a long document and 300 short ones would hold 301 x 512 rows for 1,112 tokens."""
    monkeypatch.setattr(kernels, "EFFICIENT_MIN_ROWS", 0, raising=False)  # no floor for small micro-batches: a small test
    cu = (0, *range(2, 302, 2), 812, *range(814, 1114, 2))
    T = cu[-1]
    q, k, v = _cross_qkv_of(T)
    out, lse, state = KERNELS["sdpa_efficient"].forward(q, k, v, cu)
    dout = torch.randn_like(out)
    dq, dk, dv = KERNELS["sdpa_efficient"].backward(dout, q, k, v, out, lse, cu, state=state)
    backward_calls = [(segments, longest) for op, segments, longest in contract_ops.calls if op.endswith("backward")]
    assert len(backward_calls) > 1 and sum(segments for segments, _ in backward_calls) == len(cu) - 1
    assert all(segments * math.ceil(longest / 128) * 128 <= 2 * T for segments, longest in backward_calls)
    cu_t = torch.tensor(cu)
    want_out, want_lse = _segment_math(q, k, v, cu_t, cu_t, True, 1 / 4)
    want = _segment_grads(dout, q, k, v, cu_t, cu_t, True, 1 / 4)
    for got, ref in [(out, want_out), (lse, want_lse), (dq, want[0]), (dk, want[1]), (dv, want[2])]:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def _cross_qkv_of(T, H=4, Hkv=2, d=16):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(T, h, d, generator=g) for h in (H, Hkv, Hkv)]


def _lse_by_segment_loops(native, lse, cu):
    """The segment-by-segment re-layouts the gather and scatter replace: [H, T] from native, native from lse."""
    heads_tokens = native.new_empty(native.shape[1], cu[-1])
    padded = native.new_full((len(cu) - 1, lse.shape[0], math.ceil(varlen.max_seqlen(cu) / 32) * 32), math.inf)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        heads_tokens[:, a:b] = native[i, :, : b - a]
        padded[i, :, : b - a] = lse[:, a:b]
    return heads_tokens, padded


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_lse_relayouts_are_one_gather_and_one_scatter_matching_the_segment_loops():
    cu = (0, 3, 3, 40, 41, 100)  # an empty segment and a single token among them
    g = torch.Generator().manual_seed(6)
    native, lse = torch.randn(len(cu) - 1, 4, 64, generator=g), torch.randn(4, 100, generator=g)
    want_heads_tokens, want_native = _lse_by_segment_loops(native, lse, cu)
    assert torch.equal(kernels._lse_to_heads_tokens(native, cu), want_heads_tokens)
    assert torch.equal(kernels._lse_to_native(lse, cu), want_native), "+inf past each segment's end"
    assert torch.equal(kernels._lse_to_heads_tokens(kernels._lse_to_native(lse, cu), cu), lse), "round trip"
    many = tuple(range(0, 2001, 2))  # 1,000 segments: as few operators as for 5
    with _CountOps() as counted:
        kernels._lse_to_native(kernels._lse_to_heads_tokens(torch.randn(1000, 4, 32), many), many)
    assert counted.count <= 20


@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_attn_backward_is_deterministic_exactly_when_torch_is_asked_to_be(contract_ops, deterministic):
    """flash-attn's backward accumulates dq with fp32 atomics unless told `deterministic=True`; torch's own flash
    backward follows torch.are_deterministic_algorithms_enabled(), so a bitwise check that turns it on must get
    the same from flash-attn."""
    asked = []
    record = contract_ops.flash_attn_varlen_backward

    def backward(*args, deterministic, **kwargs):
        asked.append(deterministic)
        return record(*args, **kwargs)

    kernels._flash_attn_interface._flash_attn_varlen_backward = backward
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        _against_naive(KERNELS["flash_attn"], torch.bfloat16, 3e-2)
    finally:
        torch.use_deterministic_algorithms(before)
    assert asked == [deterministic]
