"""FA3 / FA4 behind torch's flash operators, through torch's registry: process set-up, before the first attention.

torch >= 2.11 can re-register the CUDA kernels of aten::_flash_attention_forward/_backward with
FlashAttention-3's (`flash_attn_interface`, compute capability 9.0) or FlashAttention-4's
(`flash_attn.cute.interface`, 9.0 and 10.0): `sdpa_flash` then runs them with no other change.
Their support checks (torch/nn/attention/_fa3.py, _fa4.py) are what our calls satisfy: dropout 0,
no debug mask, ragged [T, H, d] inputs with cumulative boundaries, fp16/bf16 of one dtype, fp32
log-sum-exp (pinned by tests/attention/test_flash_impl.py).
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple

import torch

from megatron_lc.attention.kernels import KERNELS, Kernel, attention, first_line, naive_attention


FLASH_IMPLS = {"fa3": ("FA3", "flash_attn_interface", (9,)), "fa4": ("FA4", "flash_attn.cute.interface", (9, 10))}
"""--flash-attention-impl -> (torch's registry name, the module providing its kernels, compute capabilities)."""


FA3_WORKSPACE_LIMIT = 1 << 31
"""FA3's backward sizes its fp32 dq accumulator, padded rows x rounded head dim, in a 32-bit int."""
FA3_BLOCK_M = 64
"""Rows of FA3's backward tile (sm90, head dim <= 128, causal): each segment pads the accumulator by one."""


class AttentionCallShape(NamedTuple):
    """The shape of an attention kernel call (a run's largest): what a kernel's workspace limits and start-up check
    read."""

    tokens: int
    """Query rows of the call (a micro-batch's sequences after the all-to-all; a ring's share with one)."""
    segments: int
    """Documents in it (one per sample unless the attention mask is reset at document ends)."""
    head_dim: int
    group: int = 1
    """Query heads per kv head."""
    dtype: torch.dtype = torch.bfloat16

    def fa3_workspace_fits(self) -> bool:
        """Whether FA3's backward can size this call's dq accumulator (`hopper/flash_api.cpp`: round_up(tokens +
        segments x 64, 64) x the head dim rounded to 64/96/128/192/256, in an int)."""
        rows = -(-(self.tokens + self.segments * FA3_BLOCK_M) // FA3_BLOCK_M) * FA3_BLOCK_M
        rounded = next((r for r in (64, 96, 128, 192, 256) if self.head_dim <= r), self.head_dim)
        return rows * rounded < FA3_WORKSPACE_LIMIT


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except Exception:  # a parent package that is missing, broken, or fails on import (ABI, CUDA)
        return False


def _why_unavailable_here(impl: str) -> str:
    """'' when `impl` can be activated in this process, else why not."""
    registry_name, module, _ = FLASH_IMPLS[impl]
    if not _importable(module):
        return f"{module} is not installed"
    attention = torch.nn.attention
    if not hasattr(attention, "list_flash_attention_impls") or registry_name not in attention.list_flash_attention_impls():
        return f"this torch ({torch.__version__}) has no {registry_name} in torch.nn.attention's registry"
    return ""


def resolve_flash_impl(name: str, capability: tuple[int, int] | None,
                       why_unavailable: Callable[[str], str] | None = None, call: AttentionCallShape | None = None
                       ) -> tuple[str, str]:
    """(the implementation `--flash-attention-impl NAME` runs on a device of `capability`, why not the one asked
    for ('' when it is)). `capability` None: not CUDA, torch's own kernels. `auto` takes FA3, then FA4, where
    the device, the installation and the run's largest kernel call (`call`) allow."""
    if name == "default" or capability is None:
        return "default", ""
    why_unavailable = why_unavailable or _why_unavailable_here  # looked up now: tests stand in for the machine
    for impl in ([name] if name != "auto" else list(FLASH_IMPLS)):
        majors = FLASH_IMPLS[impl][2]
        why = "" if capability[0] in majors else \
            f"it needs compute capability {' or '.join(f'{m}.0' for m in majors)}, the GPU is {capability[0]}.{capability[1]}"
        if not why and impl == "fa3" and call is not None and not call.fa3_workspace_fits():
            why = (f"one attention call takes {call.tokens:,} tokens of head dim {call.head_dim}, past what its "
                   "backward's 32-bit workspace size holds")
        why = why or why_unavailable(impl)
        if not why:
            return impl, ""
    if name == "auto":
        return "default", ""
    return "default", f"--flash-attention-impl {name}: {why}; torch's own flash kernels run instead"


class FlashImplRefused(RuntimeError):
    """The implementation asked for by name cannot run here (one line: why)."""


def _restore_default_flash() -> None:
    """torch's own flash kernels behind its operators again, whatever a failed activation left registered."""
    attention = torch.nn.attention
    if hasattr(attention, "restore_flash_attention_impl"):
        attention.restore_flash_attention_impl(_raise_warn=False)
    if hasattr(torch._C, "_set_sdp_use_fa3"):  # set by FA3's registration before it registers its kernels
        torch._C._set_sdp_use_fa3(False)


def probe_flash_kernel(kernel: Kernel, device: torch.device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 64,
                       group: int = 2) -> str:
    """'' when `kernel` runs a tiny causal varlen forward and backward in `dtype` on `device`, at the run's head dim
    and query heads per kv head, as the fp32 reference does, else why not (its exception, or how far it is off)."""
    g = torch.Generator().manual_seed(0)
    Hkv = 2
    T, H, d, cu = 96, Hkv * group, head_dim, (0, 40, 96)
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (H, Hkv, Hkv))
    dout = torch.randn(T, H, d, generator=g)
    inputs = [t.detach().to(device, dtype, copy=True).requires_grad_() for t in (q, k, v)]
    try:
        out = attention(*inputs, cu, kernel)
        out.backward(dout.to(device, dtype))
        got = [t.detach().float().cpu() for t in (out, *(x.grad for x in inputs))]
    except Exception as e:  # a schema the kernel does not take, an ABI it does not match, a launch that fails
        return first_line(e)
    exact = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want_out = naive_attention(*exact, cu)[0]
    want_out.backward(dout)
    for what, a, b in zip(("output", "dq", "dk", "dv"), got, (want_out, *(x.grad for x in exact))):
        err = (a - b.detach()).abs().max().item() / max(b.abs().max().item(), 1e-6)
        if not err < 0.05:  # bf16 keeps about 3 significant digits; a wrong kernel is off by far more
            return f"its {what} is off the fp32 reference by {err:.3g} (relative)"
    return ""


def activate_flash_impl(name: str, device: torch.device, call: AttentionCallShape | None = None,
                        probe: Callable[[torch.device], str] | None = None) -> str:
    """Put the implementation `--flash-attention-impl NAME` resolves to behind torch's flash operators, before
    the first attention, and prove it on a tiny forward and backward at the run's head dim (`probe`, default
    `probe_flash_kernel` of torch's flash kernel); returns what runs ('default', 'fa3' or 'fa4'). Activating the
    one already active does nothing. Whatever fails (not installed, a build torch cannot register, a schema or
    numbers off the reference, a call past FA3's workspace) leaves torch's own kernels registered: with one
    warning under `auto`, refused in one line (`FlashImplRefused`) when NAME asked for it, and refused whatever
    the name when the check leaves the CUDA context unusable."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    impl, why = resolve_flash_impl(name, capability, call=call)
    if why:
        if name != "auto" and "not installed" not in why and "capability" not in why:
            raise FlashImplRefused(why.split("; torch's own")[0])
        warnings.warn(why, stacklevel=2)
    current = getattr(torch.nn.attention, "current_flash_attention_impl", lambda: None)()
    if impl == "default":
        if current is not None:  # activated earlier in this process for another run: not for this one
            _restore_default_flash()
        return impl
    if current == FLASH_IMPLS[impl][0]:
        return impl
    shape = call or AttentionCallShape(96, 2, 64)
    try:
        torch.nn.attention.activate_flash_attention_impl(FLASH_IMPLS[impl][0])
        why = (probe or (lambda dev: probe_flash_kernel(KERNELS["sdpa_flash"], dev, shape.dtype, shape.head_dim,
                                                        shape.group)))(device)
    except Exception as e:
        why = first_line(e)
    if not why:
        return impl
    _restore_default_flash()
    message = f"--flash-attention-impl {name}: {FLASH_IMPLS[impl][0]} failed its start-up check ({why})"
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception as e:  # a sticky error: nothing can run on this context any more
            raise FlashImplRefused(f"{message}, and left the GPU unusable ({first_line(e)}): restart without it "
                                   "(--flash-attention-impl default)") from e
    if name != "auto":
        raise FlashImplRefused(message + "; drop the flag to run torch's own flash kernels")
    warnings.warn(message + "; torch's own flash kernels run instead", stacklevel=2)
    return "default"


def active_flash_impl() -> str:
    """'fa3' or 'fa4' when activated behind torch's flash operators, else 'default'."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", lambda: None)()
    return next((impl for impl, (registry_name, _, _) in FLASH_IMPLS.items() if registry_name == current), "default")
