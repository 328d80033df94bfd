"""FA3 / FA4 behind torch's flash operators: which one runs, activated once, and our calls within their checks."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import _fa3

from megatron_lc.attention import flash_impl, kernel_selection, kernels
from megatron_lc.attention.flash_impl import activate_flash_impl, resolve_flash_impl
from megatron_lc.attention.kernel_selection import select_kernel
from megatron_lc.attention.kernels import KERNELS

from tests.attention.kernel_contracts import CU, FlashRecorder, _against_naive


def _available(*impls):
    return lambda impl: "" if impl in impls else "not installed"


@pytest.mark.parametrize("asked, capability, installed, want", [
    ("auto", (9, 0), ("fa3", "fa4"), "fa3"),
    ("auto", (10, 0), ("fa3", "fa4"), "fa4"),  # FA3 is sm90 only
    ("auto", (9, 0), (), "default"),
    ("auto", (8, 0), ("fa3", "fa4"), "default"),
    ("default", (9, 0), ("fa3",), "default"),
    ("fa4", (9, 0), ("fa4",), "fa4"),
    ("fa3", None, ("fa3",), "default"),  # not CUDA
])
def test_which_implementation_runs(asked, capability, installed, want):
    impl, why = resolve_flash_impl(asked, capability, _available(*installed))
    assert impl == want and why == ""


def test_an_unavailable_implementation_asked_for_by_name_falls_back_with_one_reason():
    impl, why = resolve_flash_impl("fa3", (8, 0), _available("fa3"))
    assert impl == "default" and why.startswith("--flash-attention-impl fa3: it needs compute capability 9.0")
    impl, why = resolve_flash_impl("fa3", (9, 0), _available())
    assert impl == "default" and "fa3: not installed" in why and "\n" not in why


class _Registry:
    """torch.nn.attention's registry, recorded."""

    def __init__(self):
        self.active, self.activations = None, []

    def activate(self, name):
        self.activations.append(name)
        self.active = name


@pytest.fixture
def registry(monkeypatch):
    reg = _Registry()
    monkeypatch.setattr(torch.nn.attention, "activate_flash_attention_impl", reg.activate)
    monkeypatch.setattr(torch.nn.attention, "current_flash_attention_impl", lambda: reg.active)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flash_impl, "_why_unavailable_here", lambda impl: "" if impl == "fa3" else "not installed")
    return reg


def test_activation_happens_once_and_auto_then_runs_torchs_flash_kernel(registry, monkeypatch):
    cuda = torch.device("cuda", 0)
    assert flash_impl.active_flash_impl() == "default"
    assert activate_flash_impl("auto", cuda, probe=lambda d: "") == "fa3" and registry.activations == ["FA3"]
    assert activate_flash_impl("auto", cuda) == "fa3" and registry.activations == ["FA3"]  # already active
    assert flash_impl.active_flash_impl() == "fa3"
    monkeypatch.setattr(kernel_selection, "flash_attn_available", lambda: True)  # even with flash-attn 2 installed
    assert select_kernel(cuda).name == "sdpa_flash|sdpa_efficient"
    assert activate_flash_impl("auto", torch.device("cpu")) == "default" and registry.activations == ["FA3"]


def test_unavailable_implementation_warns_once_and_activates_nothing(registry):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert activate_flash_impl("fa4", torch.device("cuda", 0)) == "default"
    assert registry.activations == [] and len(caught) == 1 and "--flash-attention-impl fa4" in str(caught[0].message)


class _LooksCuda(torch.Tensor):
    """A CPU tensor that FA3's checks take for a CUDA one (they test `is_cuda`, then the capability)."""

    @property
    def is_cuda(self):
        return True


def _as_cuda(t):
    return t.as_subclass(_LooksCuda) if isinstance(t, torch.Tensor) else t


class FA3Checked(FlashRecorder):
    """The flash operators' stand-ins, each call first put through torch's own FA3 support checks."""

    def forward(self, q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                scale=None):
        error = _fa3._fa3_forward_support_error(*map(_as_cuda, (q, k, v)), dropout_p, return_debug_mask, None, None,
                                                _as_cuda(cum_seq_q), None, None, None)
        assert error is None, error
        return super().forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                               scale=scale)

    def backward(self, dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state,
                 unused, *, scale=None):
        error = _fa3._fa3_backward_support_error(*map(_as_cuda, (dout, q, k, v, out, lse)), dropout_p,
                                                 _as_cuda(cum_seq_q), None, None)
        assert error is None, error
        return super().backward(dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                rng_state, unused, scale=scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_flash_calls_pass_torchs_fa3_support_checks(monkeypatch, dtype):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_fa3, "_get_device_major", lambda device: 9)
    rec = FA3Checked()
    monkeypatch.setitem(kernels.TORCH_OPS, "flash_forward", rec.forward)
    monkeypatch.setitem(kernels.TORCH_OPS, "flash_backward", rec.backward)
    _against_naive(KERNELS["sdpa_flash"], dtype, 3e-2)
    assert [name for name, _ in rec.calls] == ["forward", "backward"]
    with pytest.raises(AssertionError, match="dropout_p must be 0"):  # the checks are live: they refuse dropout
        q = torch.zeros(CU[-1], 2, 16, dtype=dtype)
        rec.forward(q, q, q, torch.tensor(CU, dtype=torch.int32), None, 96, 96, 0.1, True, False, scale=0.25)


# --- activation that cannot crash a run ---------------------------------------------------------


class _FailingRegistry(_Registry):
    """A registry whose activation fails as torch's does for a broken FA3 build, and records restores."""

    def __init__(self, error: BaseException | None):
        super().__init__()
        self.error, self.restores, self.sdp_flags = error, 0, []

    def activate(self, name):
        self.activations.append(name)
        if self.error is not None:
            raise self.error
        self.active = name

    def restore(self, _raise_warn=True):
        self.restores += 1
        self.active = None


def _failing_registry(monkeypatch, error):
    reg = _FailingRegistry(error)
    monkeypatch.setattr(torch.nn.attention, "activate_flash_attention_impl", reg.activate)
    monkeypatch.setattr(torch.nn.attention, "restore_flash_attention_impl", reg.restore)
    monkeypatch.setattr(torch.nn.attention, "current_flash_attention_impl", lambda: reg.active)
    monkeypatch.setattr(torch._C, "_set_sdp_use_fa3", reg.sdp_flags.append, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # a healthy context
    monkeypatch.setattr(flash_impl, "_why_unavailable_here", lambda impl: "" if impl == "fa3" else "not installed")
    return reg


def test_a_start_up_check_that_leaves_the_gpu_unusable_is_refused_even_under_auto(monkeypatch):
    reg = _failing_registry(monkeypatch, None)

    def sticky(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(torch.cuda, "synchronize", sticky)
    with pytest.raises(flash_impl.FlashImplRefused, match="left the GPU unusable .*--flash-attention-impl default"):
        activate_flash_impl("auto", torch.device("cuda", 0), probe=lambda d: "RuntimeError: CUDA error")
    assert reg.restores == 1 and reg.active is None


@pytest.mark.parametrize("error", [
    ImportError("flash_attn_3/_C.abi3.so: undefined symbol: _ZN3c104cuda9SetDevice"),  # built for another torch
    RuntimeError("Module 'flash_attn_interface' does not expose FA3 kernels"),  # kernels through pybind
    OSError("libcudart.so.13: cannot open shared object file"),
])
def test_a_failing_fa3_registration_restores_torchs_kernels_with_one_warning(monkeypatch, error):
    reg = _failing_registry(monkeypatch, error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert activate_flash_impl("auto", torch.device("cuda", 0), probe=lambda device: "") == "default"
    assert reg.activations == ["FA3"] and reg.restores == 1 and reg.sdp_flags == [False] and reg.active is None
    assert len(caught) == 1 and "FA3 failed its start-up check" in str(caught[0].message)
    assert type(error).__name__ in str(caught[0].message) and "\n" not in str(caught[0].message)


@pytest.mark.parametrize("why", ["TypeError: fwd() takes 22 positional arguments but 34 were given",
                                 "its dq is off the fp32 reference by 0.9 (relative)"])
def test_a_start_up_check_that_fails_falls_back_under_auto_and_refuses_when_asked_by_name(monkeypatch, why):
    reg = _failing_registry(monkeypatch, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert activate_flash_impl("auto", torch.device("cuda", 0), probe=lambda device: why) == "default"
    assert reg.restores == 1 and reg.active is None and len(caught) == 1 and why in str(caught[0].message)
    with pytest.raises(flash_impl.FlashImplRefused, match="fa3: FA3 failed its start-up check") as refused:
        activate_flash_impl("fa3", torch.device("cuda", 0), probe=lambda device: why)
    assert "\n" not in str(refused.value) and reg.restores == 2
    assert activate_flash_impl("fa3", torch.device("cuda", 0), probe=lambda device: "") == "fa3"  # a good build


def test_a_kernel_call_past_fa3s_workspace_limit_is_not_given_to_fa3(monkeypatch):
    """FA3's backward sizes its dq workspace, padded rows x rounded head dim, in a 32-bit int: a call past it goes to
    torch's kernels under auto, and is refused in one line when FA3 was asked for by name."""
    reg = _failing_registry(monkeypatch, None)
    call = flash_impl.AttentionCallShape
    limit = (1 << 31) // 128 - 128  # the longest one-segment call: with a tile of padding, rounded to a tile
    assert call(limit, 1, 128).fa3_workspace_fits() and not call(limit + 1, 1, 128).fa3_workspace_fits()
    assert not call(limit // 2 + 64, 1, 256).fa3_workspace_fits()  # a wider head halves it
    assert not call(limit - 1, 4096, 128).fa3_workspace_fits()  # every segment pads a tile
    past = call(limit + 1, 1, 128)
    assert activate_flash_impl("auto", torch.device("cuda", 0), call=past, probe=lambda d: "") == "default"
    with pytest.raises(flash_impl.FlashImplRefused, match="past what its backward's 32-bit workspace size holds"):
        activate_flash_impl("fa3", torch.device("cuda", 0), call=past, probe=lambda d: "")
    assert reg.activations == []
    assert activate_flash_impl("fa3", torch.device("cuda", 0), call=call(limit, 1, 128), probe=lambda d: "") == "fa3"
    # A later run in the same process whose calls FA3 cannot take gets torch's kernels back.
    assert activate_flash_impl("auto", torch.device("cuda", 0), call=past, probe=lambda d: "") == "default"
    assert reg.active is None and reg.restores == 1


def test_an_fa4_package_that_raises_on_import_counts_as_not_installed(monkeypatch):
    import importlib.util

    def broken(name, *args):
        raise RuntimeError("CUDA driver initialization failed")  # what a cute-DSL import can raise
    monkeypatch.setattr(importlib.util, "find_spec", broken)
    assert flash_impl._why_unavailable_here("fa4") == "flash_attn.cute.interface is not installed"


def _scaled(kernel, factor):
    def forward(q, k, v, cu, scale=None, **kw):
        out, lse, state = kernel.forward(q, k, v, cu, scale, **kw)
        return out * factor, lse, state
    return kernels.Kernel("scaled", forward, kernel.backward)


def test_the_start_up_probe_passes_a_right_kernel_and_names_what_is_wrong_with_another():
    cpu, ref = torch.device("cpu"), KERNELS["reference"]
    assert flash_impl.probe_flash_kernel(ref, cpu, torch.float32) == ""
    assert flash_impl.probe_flash_kernel(KERNELS["cpu_flash"], cpu, torch.bfloat16) == ""
    assert flash_impl.probe_flash_kernel(ref, cpu, torch.float32, head_dim=128, group=4) == ""  # the run's shape
    assert flash_impl.probe_flash_kernel(_scaled(ref, 1.5), cpu, torch.float32).startswith("its output is off")

    def wrong_schema(*args, **kwargs):
        raise TypeError("fwd() takes 22 positional arguments but 34 were given")
    why = flash_impl.probe_flash_kernel(kernels.Kernel("bad", wrong_schema, ref.backward), cpu, torch.float32)
    assert why == "TypeError: fwd() takes 22 positional arguments but 34 were given"
