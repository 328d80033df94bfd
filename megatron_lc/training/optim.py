"""AdamW on (sharded) parameters, resident or with its state on the host, and global-norm gradient clipping (the
schedule is in schedule.py)."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from megatron_lc.memory.offload import ExactHostBuffers, page_lock, page_unlock

LOG = logging.getLogger(__name__)


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

STAGING_BYTES = 64 << 20
"""Bytes of each of the host optimizer's two staging slots: a later micro-batch's gradient crosses to the host
through them, a slot at a time, and is added to the gradient buffer there while the other slot's copy runs."""


@dataclass(frozen=True)
class HostOptimizerBytes:
    """What `HostAdamW` keeps on the host for one rank's parameters: page-locked (its master weights, gradient
    buffers and staging, each set one exact allocation) and ordinary memory (AdamW's state: two moments and a step
    count a parameter, made at the first step or by a checkpoint load; they never cross to the accelerator)."""

    masters: int
    gradients: int
    staging: int
    state: int

    @property
    def page_locked(self) -> int:
        return self.masters + self.gradients + self.staging

    @property
    def total(self) -> int:
        return self.page_locked + self.state

    @classmethod
    def of(cls, params: list[torch.Tensor]) -> HostOptimizerBytes:
        shapes, dtype = _host_layout(params)
        weights = _nbytes(shapes, dtype)
        return cls(weights, weights, _nbytes(_staging_shapes(shapes, dtype), dtype), 2 * weights + 4 * len(shapes))


def _host_layout(params: list[torch.Tensor]) -> tuple[list[tuple[int, ...]], torch.dtype]:
    """Each parameter's local shape, and their one dtype (the fp32 master weights)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError("the host optimizer keeps one dtype of master weights; the parameters hold "
                         f"{sorted(map(str, dtypes))}")
    return [tuple(_local(p).shape) for p in params], dtypes.pop() if dtypes else torch.float32


def _staging_shapes(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[tuple[int, ...]]:
    """Two slots of at most `STAGING_BYTES`, no larger than the largest parameter."""
    largest = max((math.prod(s) for s in shapes), default=0)
    return [(min(largest, STAGING_BYTES // dtype.itemsize),)] * 2


def _nbytes(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
    return sum(math.prod(s) for s in shapes) * dtype.itemsize


class _StagedAdds:
    """Staged parts of later micro-batches' gradients added into the host buffers on a thread of their own.

    `free_slot()` hands a staging slot (waiting only while every slot is in flight), `add(done, slot, part, dst)`
    queues `dst += part` once the copy into the slot is `done` (an event, or None: copied); the thread adds in
    queue order and frees the slot. `wait()` returns when every queued add is done (and raises what an add
    raised). `threaded=False`: each add runs inside `add`, in order, on the caller's thread."""

    def __init__(self, slots: list[torch.Tensor], threaded: bool):
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for slot in slots:
            self._free.put(slot)
        self._threaded = threaded
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def free_slot(self) -> torch.Tensor:
        return self._free.get()

    def add(self, done, slot: torch.Tensor, part: torch.Tensor, dst: torch.Tensor) -> None:
        if not self._threaded:
            self._run((done, slot, part, dst))
            return
        if self._thread is None:  # the first later micro-batch: runs of one micro-batch never start it
            self._thread = threading.Thread(target=self._serve, name="host-gradient-adds", daemon=True)
            self._thread.start()
        self._queue.put((done, slot, part, dst))

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if self._error is None:  # after a failure the rest are dropped; wait() raises it
                    self._run(job)
                else:
                    self._free.put(job[1])
            except BaseException as error:  # noqa: BLE001 - handed to the training thread by wait()
                self._error = error
                self._free.put(job[1])
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _run(self, job) -> None:
        done, slot, part, dst = job
        if done is not None:
            done.synchronize()
        with torch.no_grad():
            dst.add_(part)
        self._free.put(slot)

    def wait(self) -> None:
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("adding a later micro-batch's gradient on the host failed") from error

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


class HostAdamW:
    """AdamW with its fp32 master weights, moments and gradients in host memory and its step there
    (--optimizer-cpu-offload, as Megatron-LM's): the accelerator keeps only the (sharded) fp32 parameters the
    forward reads, 4 bytes per parameter of the 16 a resident AdamW holds through the backward.

    Host memory is exact and made before step 1: the master weights, the gradient buffers and two staging slots
    are three allocations of exactly their bytes (`ExactHostBuffers`), page-locked once (`page_locked`: the
    accelerator is a GPU) where `pin_memory=True` would round each tensor up to a power of two; `host_bytes()`
    is what they and the moments hold.

    Each parameter's gradient moves to the host as soon as it is final on this rank (FSDP2 calls the
    post-accumulate-grad hook of a sharded parameter after its block's reduce-scatter, on the stream that
    reduce-scatter ran on): copied into its buffer without stalling the backward (a copy queued on that stream and
    an event recorded after it), and freed on the accelerator. A later micro-batch's gradient is added to the
    buffer through the staging slots (`_StagedAdds`): the hook queues a part's copy into a free slot and goes on;
    a thread of its own waits for that copy and adds the part on the host, then frees the slot, so the backward
    waits only when both slots are still in flight. The global norm, clipping and the AdamW step wait for every copy and add,
    then run on the host (torch's foreach AdamW: on a CPU run the arithmetic of the resident optimizer, bit for
    bit), and the new values are copied back into the parameters. Checkpoints hold the state in the resident
    optimizer's layout (`checkpoint_state`): a run resumes with or without offload, at any world size.
    """

    def __init__(self, params: list[torch.Tensor], host: torch.device, page_locked: bool, lr: float,
                 weight_decay: float, betas, eps: float):
        self.params = params
        self.host = host
        self._page_locked = page_locked  # on a GPU: copies queued on the accelerator's streams, ordered by events
        shapes, dtype = _host_layout(params)
        lock = (page_lock, page_unlock) if page_locked else (None, None)
        began = time.monotonic()
        self._masters = ExactHostBuffers(shapes, dtype, host, *lock)
        self._gradients = ExactHostBuffers(shapes, dtype, host, *lock)
        self._staging = ExactHostBuffers(_staging_shapes(shapes, dtype), dtype, host, *lock)
        if page_locked:
            LOG.info("host optimizer: page-locked %.2f GiB (master weights, gradient buffers, staging) in %.1f s",
                     self.page_locked_bytes() / 2**30, time.monotonic() - began)
        self.masters = self._masters.views
        self._grad_buffers = self._gradients.views
        # The planner's fake host runs the adds inline: its modes (fake tensors, the tracker) are this thread's.
        self._adds = _StagedAdds(self._staging.views, threaded=host.type != "meta")
        self._copies: list = []  # events after this backward's copies into the gradient buffers
        self._masters_current = False  # taken from the parameters at the first step: after any checkpoint load
        self._filled = [False] * len(params)
        self._foreach = host.type != "meta"  # the planner's fake host has no foreach clipping
        # One group per parameter: foreach AdamW's scratch (a square root of the second moment) is then one
        # parameter's at a time, not the whole shard's (4 bytes a parameter); the arithmetic is the same.
        self.inner = torch.optim.AdamW([{"params": [m]} for m in self.masters], lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, foreach=True)
        self._index = {id(p): i for i, p in enumerate(params)}
        self._copied_back = None
        self._hooks = [p.register_post_accumulate_grad_hook(self.take_gradient) for p in params]

    def take_gradient(self, param: torch.Tensor) -> None:
        """Start moving `param`'s final gradient of this backward to the host (added to an earlier micro-batch's)
        and free it on the accelerator."""
        i = self._index[id(param)]
        grad, master = _local(param.grad), self.masters[i]
        if not self._filled[i]:
            master.grad = self._grad_buffers[i]
            self._copies.append(self._to_host(master.grad, grad))
            self._filled[i] = True
        else:
            self._wait_for_copies()  # the earlier micro-batches' (done long since): the adds write their buffers
            self._add_through_staging(master.grad.view(-1), grad.reshape(-1))
        param.grad = None

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor):
        """`dst.copy_(src)`; on a GPU queued on the current stream (the reduce-scatter's, in FSDP2's hook) without
        waiting, and the event after it returned (None: done)."""
        if not self._page_locked:
            dst.copy_(src)
            return None
        stream = torch.cuda.current_stream(src.device)
        dst.copy_(src, non_blocking=True)
        if src.is_cuda:  # its memory is reused only after the copy read it (HSDP's hook runs on another stream)
            src.record_stream(stream)
        return stream.record_event()

    def _add_through_staging(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst += src` (flat), `src` crossing to the host in parts through the staging slots."""
        for start in range(0, src.numel(), max(1, self._staging.views[0].numel())):
            slot = self._adds.free_slot()
            part = slot[:min(slot.numel(), src.numel() - start)]
            done = self._to_host(part, src[start:start + part.numel()])
            self._adds.add(done, slot, part, dst[start:start + part.numel()])

    def wait_for_gradients(self) -> None:
        """Every gradient of this step on the host: the copies done, the staged parts added."""
        self._adds.wait()
        self._wait_for_copies()

    def _wait_for_copies(self) -> None:
        for done in self._copies:
            if done is not None:
                done.synchronize()
        self._copies = []

    def close(self) -> None:
        """Stop taking gradients, wait for the copies, unlock and free the host buffers (unusable after; a run's
        optimizer lives until its process exits, which frees them too)."""
        self.wait_for_gradients()
        self._adds.close()
        if self._copied_back is not None:
            self._copied_back.synchronize()
        for hook in self._hooks:
            hook.remove()
        self.masters, self._grad_buffers = [], []
        self.inner.state.clear()
        for buffers in (self._masters, self._gradients, self._staging):
            buffers.close()

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The host buffers the gradients are moved into (one per parameter, made with the optimizer)."""
        return list(self._grad_buffers)

    def host_buffers(self) -> list[torch.Tensor]:
        """Every buffer this optimizer made on the host with itself: master weights, gradient buffers, staging slots
        (AdamW's moments are in `inner`'s state)."""
        return [*self.masters, *self._grad_buffers, *self._staging.views]

    def page_locked_bytes(self) -> int:
        """Host bytes page-locked for this optimizer (0 when its memory is ordinary): exactly its master weights,
        gradient buffers and staging slots."""
        return sum(b.nbytes for b in (self._masters, self._gradients, self._staging) if b.page_locked)

    def host_bytes(self) -> int:
        """Bytes this optimizer holds on the host between steps: master weights, gradient buffers, staging slots
        and AdamW's state."""
        state = [t for held in self.inner.state.values() for t in held.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in [*self.host_buffers(), *state])

    def clip_grad_norm(self, max_norm: float | None, device: torch.device) -> torch.Tensor:
        """The global L2 norm of the host gradients (on `device`), computed as `clip_grad_norm` computes it over
        sharded gradients (each parameter's norm: its shards' norms squared, summed over the shard ranks, rooted;
        then the norm of those), and the gradients clipped to `max_norm` when set."""
        self.wait_for_gradients()
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
        self.wait_for_gradients()
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
        if self._page_locked and torch.cuda.is_available():  # the masters are not overwritten before it is read
            self._copied_back = torch.cuda.current_stream().record_event()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wait_for_gradients()  # no copy or add of this step lands in the next one's buffers
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
