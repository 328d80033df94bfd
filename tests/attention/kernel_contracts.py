"""Recording stand-ins for torch's private attention operators, shared by the kernel tests.

Each records its calls and checks every argument against the operator's own schema
(`torch.ops.aten.<op>.default._schema`) and the kernel's documented input contract (dtypes, shapes,
contiguity, defined or undefined optionals, the forward's tensors reaching the backward), then computes
the result in the operator's output layout from materialised-softmax attention.
"""

from __future__ import annotations

import math

import torch

from megatron_lc.attention.kernels import attention, naive_attention

CU = (0, 70, 71, 160, 256)  # packed documents, one of a single token
LONGEST = 96


def _check_schema(op, args: tuple, kwargs: dict) -> dict:
    """Bind args/kwargs to `op`'s schema, checking each value's type; returns name -> value."""
    schema = op._schema
    bound, positional = {}, [a for a in schema.arguments if not a.kwarg_only]
    assert len(args) <= len(positional), f"{schema.name}: {len(args)} positional arguments"
    for arg, value in zip(positional, args):
        bound[arg.name] = value
    names = {a.name for a in schema.arguments}
    for name, value in kwargs.items():
        assert name in names and name not in bound, f"{schema.name}: unexpected keyword {name}"
        bound[name] = value
    for arg in schema.arguments:
        if arg.name not in bound:
            assert arg.has_default_value(), f"{schema.name}: {arg.name} is required"
            continue
        _check_type(schema.name, arg.name, str(arg.type), bound[arg.name])
    return bound


def _check_type(op: str, name: str, type_name: str, value) -> None:
    optional = type_name.endswith("?") or type_name.startswith("Optional[")
    base = type_name.removesuffix("?").removeprefix("Optional[").removesuffix("]")
    if value is None:
        assert optional, f"{op}: {name} ({type_name}) may not be None"
        return
    expected = {"Tensor": torch.Tensor, "SymInt": int, "int": int, "float": float, "bool": bool}[base]
    assert isinstance(value, expected), f"{op}: {name} ({type_name}) got {type(value).__name__}"
    if expected is int:
        assert not isinstance(value, bool), f"{op}: {name} is an int, got a bool"


def _check_cu(t: torch.Tensor, q: torch.Tensor) -> None:
    assert t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous() and t.device == q.device
    assert tuple(t.tolist()) == CU


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor: same memory, shape and strides (autograd hands saved tensors back as new objects)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


MAX_SEGMENTS = 65_535
"""CUDA's gridDim.y/z limit, where flash-attention 2 and the memory-efficient kernels put the segments."""


def _flash_contract(a: dict, backward: bool) -> None:
    """What torch 2.11's flash_api.cpp (mha_varlen_fwd/bwd) checks or silently assumes."""
    q = a["query"]
    tensors = ("query", "key", "value") + (("grad_out", "out") if backward else ())
    for name in tensors:
        assert a[name].stride(-1) == 1, f"flash: {name} must have a contiguous last dimension"
    assert q.shape[-1] % 8 == 0, "flash: head_size must be a multiple of 8"
    assert a["cum_seq_q"].is_contiguous() and a["cum_seq_k"].is_contiguous()
    assert a["cum_seq_q"].numel() - 1 <= MAX_SEGMENTS, "flash: segments go in gridDim.y"
    if backward:  # read through its data pointer as a dense [heads, total_q] array, unchecked
        lse = a["logsumexp"]
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()


def _efficient_contract(a: dict, backward: bool) -> None:
    """What torch 2.11's memory-efficient operators check (attention_backward.cu, CHECK_NOSPARSE_LASTCONTIGUOUS)
    or assume (kernel_backward.h: `out` is read with rows heads * d apart, `o_strideM()`)."""
    for name in ("query", "key", "value"):
        assert a[name].dim() == 4 and a[name].shape[0] == 1 and a[name].stride(-1) == 1, f"{name}: [1, T, H, d]"
    assert a["cu_seqlens_q"].is_contiguous() and a["cu_seqlens_k"].is_contiguous()
    assert a["cu_seqlens_q"].numel() - 1 <= MAX_SEGMENTS, "memory-efficient: segments go in gridDim.z"
    if backward:
        for name in ("out", "grad_out_"):
            assert a[name].is_contiguous(), f"memory-efficient backward: {name} rows must be heads * d apart"
        assert a["logsumexp"].is_contiguous()


def _naive_segments(q, k, v, scale):
    """fp64 out [T, H, d] and lse [H, T] of q, k, v [T, H*, d]."""
    qd, kd, vd = (t.detach().double() for t in (q, k, v))
    out, lse = naive_attention(qd, kd, vd, CU, scale)
    return out, lse


def _naive_grads(dout, q, k, v, scale):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():  # the stand-ins run inside autograd's backward
        out, _ = naive_attention(qd, kd, vd, CU, scale)
        out.backward(dout.detach().double())
    return qd.grad, kd.grad, vd.grad


class _Recorder:
    """Calls received (op name, arguments by schema name) and what the forward returned."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.returned: dict = {}


class FlashRecorder(_Recorder):
    """Stand-ins for `_flash_attention_forward/_backward` (variable-length path)."""

    def forward(self, *args, **kwargs):
        a = _check_schema(torch.ops.aten._flash_attention_forward.default, args, kwargs)
        _flash_contract(a, backward=False)
        q, k, v = a["query"], a["key"], a["value"]
        for t in (q, k, v):
            assert t.dtype in (torch.float16, torch.bfloat16) and t.dim() == 3 and t.stride(-1) == 1
        assert q.shape[1] % k.shape[1] == 0 and k.shape == v.shape, "GQA: kv heads as they are"
        for name in ("cum_seq_q", "cum_seq_k"):
            _check_cu(a[name], q)
        assert a["max_q"] == a["max_k"] == LONGEST and a["dropout_p"] == 0.0 and a["is_causal"] is True
        assert a["return_debug_mask"] is False and isinstance(a["scale"], float)
        out, lse = _naive_segments(q, k, v, a["scale"])
        self.returned = dict(out=out.to(q.dtype), lse=lse.float(), rng_state=torch.empty(2, dtype=torch.int64),
                             unused=torch.empty((), dtype=torch.int64), cum_seq_q=a["cum_seq_q"])
        self.calls.append(("forward", a))
        r = self.returned
        return r["out"], r["lse"], r["rng_state"], r["unused"], torch.empty(0, dtype=q.dtype)

    def backward(self, *args, **kwargs):
        a = _check_schema(torch.ops.aten._flash_attention_backward.default, args, kwargs)
        _flash_contract(a, backward=True)
        r = self.returned
        q, k = a["query"], a["key"]
        assert _same(a["out"], r["out"]) and _same(a["logsumexp"], r["lse"]), "the forward's out and lse"
        assert _same(a["rng_state"], r["rng_state"]) and _same(a["unused"], r["unused"]), "the forward's rng tensors"
        assert a["cum_seq_q"] is r["cum_seq_q"] and a["cum_seq_k"] is r["cum_seq_q"], "cu_seqlens built once"
        assert a["grad_out"].is_contiguous() and a["grad_out"].shape == q.shape
        assert a["max_q"] == a["max_k"] == LONGEST and a["dropout_p"] == 0.0 and a["is_causal"] is True
        self.calls.append(("backward", a))
        dq, dk, dv = _naive_grads(a["grad_out"], q, k, a["value"], a["scale"])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(k.dtype)


class EfficientRecorder(_Recorder):
    """Stand-ins for `_efficient_attention_forward/_backward` (cu_seqlens path)."""

    def forward(self, *args, **kwargs):
        a = _check_schema(torch.ops.aten._efficient_attention_forward.default, args, kwargs)
        _efficient_contract(a, backward=False)
        q, k, v = a["query"], a["key"], a["value"]
        for t in (q, k, v):
            assert t.dim() == 4 and t.shape[0] == 1 and t.stride(-1) == 1, "[1, total, heads, d]"
        assert q.shape[2] == k.shape[2] == v.shape[2], "no GQA in the memory-efficient kernel"
        assert a["bias"] is None and a["custom_mask_type"] == 1 and a["compute_log_sumexp"] is True
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            _check_cu(a[name], q)
        assert a["max_seqlen_q"] == a["max_seqlen_k"] == LONGEST and a["dropout_p"] == 0.0
        out, lse = _naive_segments(q[0], k[0], v[0], a["scale"])
        padded = math.ceil(LONGEST / 32) * 32
        native = torch.full((len(CU) - 1, q.shape[2], padded), float("nan"))  # padding must never be read
        for i, (s, e) in enumerate(zip(CU[:-1], CU[1:])):
            native[i, :, : e - s] = lse[:, s:e].float()
        self.returned = dict(out=out.to(q.dtype).unsqueeze(0), lse=native, seed=torch.empty((), dtype=torch.int64),
                             offset=torch.empty((), dtype=torch.int64))
        self.calls.append(("forward", a))
        r = self.returned
        return r["out"], r["lse"], r["seed"], r["offset"], LONGEST, LONGEST

    def backward(self, *args, **kwargs):
        a = _check_schema(torch.ops.aten._efficient_attention_backward.default, args, kwargs)
        _efficient_contract(a, backward=True)
        r = self.returned
        q, k, v = a["query"], a["key"], a["value"]
        lse, native = a["logsumexp"], r["lse"]
        assert lse.shape == native.shape and lse.dtype == native.dtype and lse.is_contiguous(), "native lse layout"
        for i, (s, e) in enumerate(zip(CU[:-1], CU[1:])):
            assert torch.equal(lse[i, :, : e - s], native[i, :, : e - s]), "the lse it is given, re-laid out"
            assert torch.isinf(lse[i, :, e - s:]).all() and (lse[i, :, e - s:] > 0).all(), "padding +inf as the forward's"
        assert _same(a["philox_seed"], r["seed"]) and _same(a["philox_offset"], r["offset"])
        assert a["out"].shape == r["out"].shape and a["bias"] is None and a["bias_requires_grad"] is False
        assert q.shape[2] == k.shape[2] and a["custom_mask_type"] == 1
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            _check_cu(a[name], q)
        self.calls.append(("backward", a))
        dq, dk, dv = _naive_grads(a["grad_out_"][0], q[0], k[0], v[0], a["scale"])
        return dq.to(q.dtype)[None], dk.to(k.dtype)[None], dv.to(v.dtype)[None], torch.empty(0)


def _qkv(dtype, H=8, Hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(CU[-1], h, d, generator=g).to(dtype).requires_grad_() for h in (H, Hkv, Hkv)]


def _against_naive(kernel, dtype, tol):
    q, k, v = _qkv(dtype)
    out = attention(q, k, v, CU, kernel)
    dout = torch.randn_like(out)
    out.backward(dout)
    want_out, _ = _naive_segments(q, k, v, 1 / 4)
    want = _naive_grads(dout, q, k, v, 1 / 4)
    for got, ref in [(out, want_out), (q.grad, want[0]), (k.grad, want[1]), (v.grad, want[2])]:
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


class EfficientOpsOnAnySegments:
    """Stand-ins for the memory-efficient operators on any segmentation (fp32 CPU math by the reference kernel),
    for the kernel's calls as a caller makes them: `ops` goes to `sdpa_efficient_forward/_backward`.

    Each forward call returns philox tensors of its own; each backward call must be handed the philox tensors
    of the forward call over the same rows and segments, and each forward's exactly once (`check_all_used`)."""

    def __init__(self):
        self.forwards: list[dict] = []
        self.used: list[int] = []
        self.ops = {"efficient_forward": self.forward, "efficient_backward": self.backward}

    @staticmethod
    def _call(op, args, kwargs):
        """The checked arguments, q, k, v of the call, its boundaries and whether it is causal."""
        a = _check_schema(op, args, kwargs)
        _efficient_contract(a, backward=op is torch.ops.aten._efficient_attention_backward.default)
        cu_q, cu_k = tuple(a["cu_seqlens_q"].tolist()), tuple(a["cu_seqlens_k"].tolist())
        return a, a["query"][0], a["key"][0], a["value"][0], cu_q, cu_k, a["custom_mask_type"] == 1

    def forward(self, *args, **kwargs):
        from megatron_lc.attention.kernels import reference_forward

        a, q, k, v, cu_q, cu_k, causal = self._call(torch.ops.aten._efficient_attention_forward.default, args, kwargs)
        assert a["max_seqlen_q"] == max(y - x for x, y in zip(cu_q, cu_q[1:]))
        out, lse, _ = reference_forward(q, k, v, cu_q, a["scale"], cu_seqlens_k=None if causal else cu_k,
                                        causal=causal)
        padded = math.ceil(a["max_seqlen_q"] / 32) * 32
        native = torch.full((len(cu_q) - 1, q.shape[1], padded), math.inf)
        for i, (s, e) in enumerate(zip(cu_q[:-1], cu_q[1:])):
            native[i, :, : e - s] = lse[:, s:e]
        seed, offset = torch.tensor(len(self.forwards)), torch.tensor(-len(self.forwards))
        self.forwards.append(dict(seed=seed, offset=offset, cu_q=cu_q, cu_k=cu_k, causal=causal, rows=q.shape[0]))
        return out[None], native, seed, offset, a["max_seqlen_q"], a["max_seqlen_k"]

    def backward(self, *args, **kwargs):
        from megatron_lc.attention.kernels import reference_backward

        a, q, k, v, cu_q, cu_k, causal = self._call(torch.ops.aten._efficient_attention_backward.default, args, kwargs)
        matches = [i for i, f in enumerate(self.forwards) if _same(a["philox_seed"], f["seed"])
                   and _same(a["philox_offset"], f["offset"])]
        assert len(matches) == 1, "philox tensors that no forward call returned"
        f = self.forwards[matches[0]]
        assert (f["cu_q"], f["cu_k"], f["causal"], f["rows"]) == (cu_q, cu_k, causal, q.shape[0]), \
            "the philox tensors of another call's forward"
        self.used.append(matches[0])
        native = a["logsumexp"]
        lse = torch.cat([native[i, :, : e - s] for i, (s, e) in enumerate(zip(cu_q[:-1], cu_q[1:]))], dim=1)
        dq, dk, dv = reference_backward(a["grad_out_"][0], q, k, v, a["out"][0], lse, cu_q, a["scale"],
                                        cu_seqlens_k=None if causal else cu_k, causal=causal)
        return dq[None], dk[None], dv[None], torch.empty(0)

    def check_all_used(self) -> None:
        assert sorted(self.used) == list(range(len(self.forwards))), "every forward call's state used exactly once"
