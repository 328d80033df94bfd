"""AdamW on (sharded) parameters, resident or with its state on the host, and global-norm gradient clipping (the
schedule is in schedule.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.95),
                    eps: float = 1e-8, fused: bool | None = None, host: torch.device | None = None,
                    page_locked: bool = False) -> torch.optim.AdamW | HostAdamW:
    """AdamW; fused on CUDA (torch's own kernel), foreach elsewhere (`fused` decides instead: the planner traces
    a CUDA run's fused AdamW on fake tensors). With `host`, its state and step on that device (`HostAdamW`,
    its buffers page-locked when `page_locked`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if host is not None:
        return HostAdamW(params, host, page_locked, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    fused = all(p.device.type == "cuda" for p in params) if fused is None else fused
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=fused or None, foreach=None if fused else True)


def clip_grad_norm(parameters, max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of all gradients (over every shard), and clipping to max_norm when set."""
    with_grad = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # sums the per-shard partial norms over the mesh
    if max_norm is not None and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach=True)
    return total


HOST_STATE_BYTES_PER_PARAMETER = 16
"""What the host holds per parameter with the optimizer there (--optimizer-cpu-offload: fp32 master weight, gradient
buffer and two moments) or with FSDP's CPU offload (fp32 sharded parameter, gradient and two moments)."""


class HostAdamW:
    """AdamW with its fp32 master weights, moments and gradients in host memory and its step there
    (--optimizer-cpu-offload, as Megatron-LM's): the accelerator keeps only the (sharded) fp32 parameters the
    forward reads, 4 bytes per parameter of the 16 a resident AdamW holds through the backward.

    Each parameter's gradient moves to the host as soon as it is final on this rank (FSDP2 calls the
    post-accumulate-grad hook of a sharded parameter after its block's reduce-scatter): copied, or added to the
    host copy on later micro-batches, and freed on the accelerator. The global norm, clipping and the AdamW step
    then run on the host (torch's foreach AdamW: on a CPU run the arithmetic of the resident optimizer, bit for
    bit), and the new values are copied back into the parameters. Checkpoints hold the state in the resident
    optimizer's layout (`checkpoint_state`): a run resumes with or without offload, at any world size.
    """

    def __init__(self, params: list[torch.Tensor], host: torch.device, page_locked: bool, lr: float,
                 weight_decay: float, betas, eps: float):
        self.params = params
        self.host = host
        self._page_locked = page_locked
        self.masters = [torch.empty(_local(p).shape, dtype=p.dtype, device=host, pin_memory=page_locked)
                        for p in params]
        self._masters_current = False  # taken from the parameters at the first step: after any checkpoint load
        self._filled = [False] * len(params)
        self._grad_buffers: list[torch.Tensor | None] = [None] * len(params)
        self._foreach = host.type != "meta"  # the planner's fake host has no foreach clipping
        # One group per parameter: foreach AdamW's scratch (a square root of the second moment) is then one
        # parameter's at a time, not the whole shard's (4 bytes a parameter); the arithmetic is the same.
        self.inner = torch.optim.AdamW([{"params": [m]} for m in self.masters], lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, foreach=True)
        self._index = {id(p): i for i, p in enumerate(params)}
        self._copied_back = None
        self._hooks = [p.register_post_accumulate_grad_hook(self.take_gradient) for p in params]

    def take_gradient(self, param: torch.Tensor) -> None:
        """Move `param`'s final gradient of this backward to the host (added to an earlier micro-batch's) and
        free it on the accelerator."""
        i = self._index[id(param)]
        grad, master = _local(param.grad), self.masters[i]
        if not self._filled[i]:
            if self._grad_buffers[i] is None:  # one host buffer per parameter, kept across steps
                self._grad_buffers[i] = torch.empty(master.shape, dtype=master.dtype, device=self.host,
                                                    pin_memory=self._page_locked)
            master.grad = self._grad_buffers[i].copy_(grad)
            self._filled[i] = True
        else:
            master.grad.add_(grad.to(self.host))
        param.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The host buffers the gradients are moved into (allocated at a parameter's first gradient)."""
        return [b for b in self._grad_buffers if b is not None]

    def host_bytes(self) -> int:
        """Bytes this optimizer holds on the host between steps: master weights, gradient buffers and AdamW's
        state."""
        tensors = [*self.masters, *(b for b in self._grad_buffers if b is not None),
                   *(t for state in self.inner.state.values() for t in state.values() if torch.is_tensor(t))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def clip_grad_norm(self, max_norm: float | None, device: torch.device) -> torch.Tensor:
        """The global L2 norm of the host gradients (on `device`), computed as `clip_grad_norm` computes it over
        sharded gradients (each parameter's norm: its shards' norms squared, summed over the shard ranks, rooted;
        then the norm of those), and the gradients clipped to `max_norm` when set."""
        with_grad = [m for m in self.masters if m.grad is not None]
        grads = [m.grad for m in with_grad]
        norms = torch.stack(torch._foreach_norm(grads, 2.0)) if grads else torch.zeros(1)
        norms = norms.to(device)
        groups = _shard_groups(self.params)
        if groups:
            norms = norms ** 2.0
            for group in groups:
                dist.all_reduce(norms, group=group)
            norms = norms ** (1.0 / 2.0)
        total = torch.linalg.vector_norm(norms, 2.0)
        if max_norm is not None and max_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total.to(self.host), foreach=self._foreach)
        return total

    def step(self) -> None:
        if self._copied_back is not None:
            self._copied_back.synchronize()
        if not self._masters_current:
            with torch.no_grad():
                for p, master in zip(self.params, self.masters):
                    master.copy_(_local(p))
            self._masters_current = True
        self.inner.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                _local(p).copy_(master, non_blocking=self._page_locked)
        if self._page_locked and torch.cuda.is_available():
            self._copied_back = torch.cuda.current_stream().record_event()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._filled = [False] * len(self.params)
        for p, master in zip(self.params, self.masters):
            p.grad = master.grad = None  # a parameter without a gradient next step is not stepped

    # --- checkpoints: the resident AdamW's layout ------------------------------------------------

    def checkpoint_state(self, names: dict[int, str], empty: bool = False) -> dict:
        """`get_optimizer_state_dict`'s structure (state by parameter name, param_groups naming them), the
        moments as DTensors of the parameters' layout over the host tensors themselves (a save reads them, a load
        writes into them: nothing crosses to the accelerator); `empty`: host tensors to load into (the moments
        themselves once they exist, zeros before)."""
        state = {}
        for p, master in zip(self.params, self.masters):
            held = self.inner.state.get(master)
            if held is None and not empty:
                continue
            entry = {"step": torch.zeros((), dtype=torch.float32) if held is None else held["step"]}
            for key in ("exp_avg", "exp_avg_sq"):
                local = torch.zeros_like(master) if held is None else held[key]
                entry[key] = _on_host_like_param(local, p)
            state[names[id(p)]] = entry
        settings = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}  # every group's
        return {"state": state, "param_groups": [{**settings, "params": [names[id(p)] for p in self.params]}]}

    def load_checkpoint_state(self, loaded: dict, names: dict[int, str]) -> None:
        """Take the state `checkpoint_state(empty=True)` was loaded into (the master weights follow the
        parameters at the next step)."""
        for p, master in zip(self.params, self.masters):
            entry = loaded["state"][names[id(p)]]
            self.inner.state[master] = {
                "step": torch.as_tensor(entry["step"], dtype=torch.float32).clone(),
                **{key: _local(entry[key]).to(self.host) for key in ("exp_avg", "exp_avg_sq")}}  # loaded in place
        saved = loaded["param_groups"][0]  # the resident optimizer's one group
        for group in self.inner.param_groups:
            group.update({k: v for k, v in saved.items() if k != "params"})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _on_host_like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local` as this rank's shard of a DTensor laid out as `param`, left where it is. `DTensor.from_local` would
    copy it to the mesh's device type (the accelerator: 8 bytes a parameter of moments at every save and load);
    the DTensor constructor (the same in torch 2.11 to 2.13) wraps it as it is, and checkpointing reads and fills
    a DTensor's local shard on any device."""
    if not isinstance(param, DTensor):
        return local
    meta = TensorMeta(param.shape, param.stride(), local.dtype)
    return DTensor(local, DTensorSpec(param.device_mesh, param.placements, tensor_meta=meta), requires_grad=False)


def _shard_groups(params) -> list:
    """The process groups the parameters are sharded over (none in one process)."""
    first = next((p for p in params if isinstance(p, DTensor)), None)
    if first is None:
        return []
    return [first.device_mesh.get_group(i) for i, placement in enumerate(first.placements) if placement.is_shard()]
