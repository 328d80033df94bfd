"""The host optimizer's memory on a GPU, pinned by CPU stand-ins of the driver and the streams: exact page-locked
buffers made before step 1, a later micro-batch's gradient staged through reused page-locked slots, and copies
that never stall the backward, waited on before the norm and the step."""

import math
import os
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lc.training import optim
from megatron_lc.training.optim import HostAdamW, HostOptimizerBytes


class _FakeCudart:
    """cudaHostRegister/Unregister recording each registration (address, bytes)."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, address, nbytes, flags):
        self.registered.append((address, nbytes))
        return 0

    def cudaHostUnregister(self, address):
        self.unregistered.append(address)
        return 0


class _Stream:
    """A stream that records the events recorded on it and their waits into `log`."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def record_event(self):
        return _Event(self, self.log)


class _Event:
    count = 0

    def __init__(self, stream, log):
        _Event.count += 1
        self.name, self.log = f"e{_Event.count}", log
        log.append(("record", self.name, stream.name))

    def synchronize(self):
        self.log.append(("wait", self.name, threading.current_thread().name))


class _Recorder(TorchDispatchMode):
    """Logs the copies (with non_blocking) and adds into host buffers, and the first norm."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "copy_":
            self.log.append(("copy", args[0].data_ptr(), kwargs.get("non_blocking", args[2] if len(args) > 2 else False)))
        elif name == "add_":
            self.log.append(("add", args[0].data_ptr(), args[1].data_ptr()))
        elif name == "_foreach_norm":
            self.log.append(("norm",))
        return func(*args, **kwargs)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def _host_optimizer(model, page_locked):
    params = list(model.parameters())
    return HostAdamW(params, torch.device("cpu"), page_locked, lr=0.1, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _within(t, ranges):
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(a <= start and end <= a + n for a, n in ranges)


@pytest.fixture
def cudart(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_page_locked_host_memory_is_exactly_what_host_bytes_and_the_planner_count(cudart, monkeypatch):
    """Master weights, gradient buffers and staging: three registrations of exactly their bytes, made with the
    optimizer (before any backward), every buffer inside them; `host_bytes()` is those and AdamW's state, as
    `HostOptimizerBytes` (what the preflight weighs) says. `pin_memory=True` would have rounded each tensor up."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream("default", []))
    model = _model()
    optimizer = _host_optimizer(model, page_locked=True)
    expected = HostOptimizerBytes.of(list(model.parameters()))
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert (expected.masters, expected.gradients, expected.state) == (weights, weights, 2 * weights + 4 * 4)
    assert expected.staging == 2 * max(p.numel() for p in model.parameters()) * 4
    assert [n for _, n in cudart.registered] == [expected.masters, expected.gradients, expected.staging]
    assert sum(n for _, n in cudart.registered) == optimizer.page_locked_bytes() == expected.page_locked
    for buffer in (*optimizer.masters, *optimizer.gradient_buffers()):
        assert _within(buffer, cudart.registered)
    assert all(address % 4096 == 0 for address, _ in cudart.registered)  # no page shared with other memory
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    assert len(cudart.registered) == 3, "nothing page-locked after the optimizer was made"
    assert optimizer.host_bytes() == expected.total == expected.page_locked + expected.state


def test_closing_the_optimizer_unlocks_its_buffers_and_stops_taking_gradients(cudart):
    model = _model()
    optimizer = _host_optimizer(model, page_locked=True)
    registered = [address for address, _ in cudart.registered]
    optimizer.close()
    assert sorted(cudart.unregistered) == sorted(registered)
    model(torch.randn(2, 6)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_on_a_gpu_gradient_copies_do_not_stall_the_backward_and_are_waited_on_before_the_norm(cudart, monkeypatch):
    """Each gradient is copied without blocking, an event recorded after it on the stream its hook runs on (FSDP2's
    reduce-scatter stream); nothing waits in the first micro-batch's backward. A later micro-batch's gradient goes
    through the two staging slots (parts of at most STAGING_BYTES): the hook only queues each part's copy; a thread
    of its own waits for that copy and adds the part, and the slot is reused only after its add. Every copy and add
    is done before the norm reads a gradient; the result is the sum."""
    monkeypatch.setattr(optim, "STAGING_BYTES", 4 * 8)  # parts of 8 elements: the 30-element weight in 4
    log = []
    reduce_scatter = _Stream("reduce-scatter", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: reduce_scatter)
    run = optim._StagedAdds._run

    def recorded_run(self, job):  # dispatch modes are per thread: the adds' thread records its own
        with _Recorder(log):
            run(self, job)

    monkeypatch.setattr(optim._StagedAdds, "_run", recorded_run)
    model = _model()
    optimizer = _host_optimizer(model, page_locked=True)
    staging = optimizer._staging.views
    batches = [torch.randn(2, 6), torch.randn(2, 6)]
    with _Recorder(log):
        model(batches[0]).sum().backward()
    first = list(log)
    copies = [e for e in first if e[0] == "copy"]
    assert len(copies) == 4 and all(nb for _, _, nb in copies)
    assert [e[0] for e in first] == ["copy", "record"] * 4 and all(e[2] == "reduce-scatter" for e in first[1::2])
    log.clear()
    with _Recorder(log):
        model(batches[1]).sum().backward()
        optimizer.clip_grad_norm(None, torch.device("cpu"))
    norm = log.index(("norm",))
    recorded = [e[1] for e in first + log if e[0] == "record"]
    assert {e[1] for e in log[:norm] if e[0] == "wait"} == set(recorded), "every copy waited on before the norm"
    staged = [e for e in log[:norm] if e[0] == "copy"]
    assert staged and all(nb and any(_within_ptr(ptr, s) for s in staging) for _, ptr, nb in staged)
    parts = sum(math.ceil(p.numel() / 8) for p in model.parameters())
    assert len(staged) == parts and sum(e[0] == "add" for e in log[:norm]) == parts
    staged_events = {e[1] for e in log if e[0] == "record"}
    waits = {e[1]: e[2] for e in log if e[0] == "wait"}
    assert {waits[name] for name in staged_events} == {"host-gradient-adds"}, "the backward waits on no staged copy"
    adds_thread = [e[0] for e in log if e[0] == "add" or (e[0] == "wait" and e[2] == "host-gradient-adds")]
    assert adds_thread == ["wait", "add"] * parts, "a staged part is added only once its copy was waited on"
    first_adds = next(i for i, e in enumerate(log) if e[0] == "add")
    first_copies = {e[1] for e in first if e[0] == "record"}  # the buffers the adds write are filled first
    assert first_copies <= {e[1] for e in log[:first_adds] if e[0] == "wait"}
    at = [i for i, e in enumerate(log) if e[0] == "copy"]
    for n, i in enumerate(at[len(staging):]):  # the (n + 3)-th part's copy waits for a slot: the n-th add done
        assert sum(e[0] == "add" for e in log[:i]) >= n + 1
    _assert_the_resident_sum(optimizer, batches)


def _assert_the_resident_sum(optimizer, batches):
    """The host gradients are those autograd accumulates over `batches` on the same weights, bit for bit."""
    reference = _model()
    for batch in batches:
        reference(batch).sum().backward()
    for master, p in zip(optimizer.masters, reference.parameters()):
        assert torch.equal(master.grad, p.grad)


def _within_ptr(ptr, view):
    return view.data_ptr() <= ptr < view.data_ptr() + view.numel() * view.element_size()


def test_later_micro_batches_cross_through_the_staging_slots_made_with_the_optimizer_bit_for_bit():
    """On a CPU accelerator the same path runs with plain copies: the second micro-batch's gradients pass through
    the two slots made with the optimizer, and the gradients equal the resident sum bit for bit."""
    model = _model()
    optimizer = _host_optimizer(model, page_locked=False)
    batches = [torch.randn(2, 6), torch.randn(2, 6)]
    model(batches[0]).sum().backward()
    log = []
    with _Recorder(log):
        model(batches[1]).sum().backward()
        optimizer.wait_for_gradients()
    staging = optimizer._staging.views
    copies = [ptr for e in log if e[0] == "copy" for ptr in [e[1]]]
    assert copies and all(any(_within_ptr(ptr, s) for s in staging) for ptr in copies)
    _assert_the_resident_sum(optimizer, batches)


def test_on_a_gpu_the_run_sets_the_host_steps_threads_from_the_nodes_cores_and_processes(cudart, monkeypatch):
    """torchrun gives each of several processes OMP_NUM_THREADS=1; the host step takes its share of the node."""
    from megatron_lc.arguments import parse_config
    from megatron_lc.devices import Devices
    from megatron_lc.parallel_state import host_threads_per_process
    from megatron_lc.training.build import build_run_optimizer
    from tests.helpers import TRAIN_FLAGS

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    cfg = parse_config(TRAIN_FLAGS + ["--optimizer-cpu-offload"])
    optimizer = build_run_optimizer(_model(), cfg, Devices(torch.device("cuda"), torch.device("cpu")))
    assert isinstance(optimizer, HostAdamW) and optimizer.page_locked_bytes() > 0
    assert chosen == [host_threads_per_process()] and chosen[0] == len(os.sched_getaffinity(0))


def test_an_add_that_fails_on_the_adds_thread_is_raised_when_the_gradients_are_waited_for():
    """The adds' thread keeps a failure for the training thread (never lost with the thread), drops the adds
    queued after it, and frees every slot: the next step starts with both."""
    slots = [torch.zeros(4), torch.zeros(4)]
    adds = optim._StagedAdds(slots, threaded=True)
    dst = torch.zeros(4)
    for part in (torch.ones(4), torch.ones(3), torch.ones(4)):  # the second cannot be added to 4 elements
        slot = adds.free_slot()
        slot[:part.numel()].copy_(part)
        adds.add(None, slot, slot[:part.numel()], dst)
    with pytest.raises(RuntimeError, match="adding a later micro-batch's gradient on the host failed"):
        adds.wait()
    assert torch.equal(dst, torch.ones(4))  # the first add only
    assert {adds.free_slot().data_ptr(), adds.free_slot().data_ptr()} == {s.data_ptr() for s in slots}
    adds.wait()  # raised once
    adds.close()
