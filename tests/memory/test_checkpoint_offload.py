"""checkpoint_block (with and without host offload) and the offload scheduler."""

import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_lc.memory import (
    OffloadScheduler,
    checkpoint_block,
    linear_cross_entropy,
    tiled_linear_cross_entropy,
    tiled_swiglu_mlp,
)

CPU = torch.device("cpu")


class Block(nn.Module):
    """A pre-norm residual block: x + W2 silu(W1 RMSNorm(x)); optionally a tiled SwiGLU."""

    def __init__(self, hidden, ffn, mlp_tiles=None):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.mlp_tiles = mlp_tiles
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        h = self.norm(x)
        if self.mlp_tiles is None:
            return x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x + tiled_swiglu_mlp(
            h, self.gate.weight, self.up.weight, self.down.weight, self.mlp_tiles
        )


def _stack(num_blocks=3, hidden=16, ffn=48, mlp_tiles=None):
    torch.manual_seed(1)
    return nn.ModuleList(Block(hidden, ffn, mlp_tiles) for _ in range(num_blocks))


def _run(blocks, x, mode, offload=None):
    for i, block in enumerate(blocks):
        x = (
            block(x)
            if mode == "plain"
            else checkpoint_block(block, x, offload=offload, layer_idx=i)
        )
    return x


def _param_grads(blocks):
    grads = {name: p.grad.clone() for name, p in blocks.named_parameters()}
    blocks.zero_grad(set_to_none=True)
    return grads


def _assert_rel_close(got, want, rel):
    err = (got - want).abs().max().item()
    assert err <= rel * max(want.abs().max().item(), 1e-30), f"error {err:.3g}"


@pytest.mark.parametrize("use_offload, prefetch", [(False, True), (True, True), (True, False)],
                         ids=["no-offload", "offload-prefetch", "offload-on-demand"])
def test_checkpoint_block_matches_plain(use_offload, prefetch):
    blocks = _stack()
    x = torch.randn(2, 10, 16, requires_grad=True)
    grad_out = torch.randn(2, 10, 16)

    ref = _run(blocks, x, "plain")
    ref.backward(grad_out)
    want_x, want = x.grad.clone(), _param_grads(blocks)
    x.grad = None

    offload = OffloadScheduler(len(blocks), keep_last=1, accelerator=CPU, prefetch=prefetch) if use_offload else None
    out = _run(blocks, x, "checkpoint", offload)
    if use_offload:
        assert offload.host_bytes_in_use == 2 * x.numel() * 4  # layers 0 and 1 offloaded
    out.backward(grad_out)

    _assert_rel_close(out, ref, 1e-6)
    _assert_rel_close(x.grad, want_x, 1e-5)
    got = _param_grads(blocks)
    assert got.keys() == want.keys()
    for name in want:
        _assert_rel_close(got[name], want[name], 1e-5)
    if use_offload:
        assert offload.host_bytes_in_use == 0 and offload.host_bytes_peak == 2 * x.numel() * 4


def test_all_techniques_together_match_plain():
    plain, tiled = _stack(mlp_tiles=None), _stack(mlp_tiles=3)
    tiled.load_state_dict(plain.state_dict())
    head = torch.randn(40, 16) * 0.3
    x = torch.randn(1, 22, 16)
    labels = torch.randint(0, 40, (22,))
    labels[3] = -100
    offload = OffloadScheduler(3, keep_last=1, accelerator=CPU)

    loss, count = linear_cross_entropy(_run(plain, x, "plain")[0], head.requires_grad_(), labels)
    (loss / count).backward()
    want, want_head = _param_grads(plain), head.grad.clone()
    head.grad = None
    hidden = _run(tiled, x, "checkpoint", offload)[0]
    tiled_loss, tiled_count = tiled_linear_cross_entropy(hidden, head, labels, 4)
    (tiled_loss / tiled_count).backward()

    _assert_rel_close(tiled_loss.detach(), loss.detach(), 1e-6)
    _assert_rel_close(head.grad, want_head, 1e-5)
    for name, grad in _param_grads(tiled).items():
        _assert_rel_close(grad, want[name], 1e-5)


def test_checkpoint_block_input_without_grad_still_gives_parameter_grads():
    blocks = _stack(num_blocks=1)
    x = torch.randn(5, 16)
    checkpoint_block(blocks[0], x).sum().backward()
    assert all(p.grad is not None for p in blocks.parameters())
    assert x.grad is None


def test_checkpoint_block_preserves_autocast():
    blocks = _stack(num_blocks=2)
    x = torch.randn(6, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _run(blocks, x, "plain")
    ref.float().sum().backward()
    want = _param_grads(blocks)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _run(blocks, x, "checkpoint")
    out.float().sum().backward()
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref)
    for name, grad in _param_grads(blocks).items():
        torch.testing.assert_close(grad, want[name])


def test_checkpoint_block_without_grad_runs_plainly():
    blocks = _stack(num_blocks=1)
    x = torch.randn(4, 16)
    offload = OffloadScheduler(1, keep_last=0, accelerator=CPU)
    with torch.no_grad():
        out = checkpoint_block(blocks[0], x, offload=offload, layer_idx=0)
    assert out.grad_fn is None and offload.host_bytes_peak == 0


def test_offload_pool_accounting_and_reuse_across_steps():
    blocks = _stack(num_blocks=4)
    offload = OffloadScheduler(4, keep_last=1, keep_first=1, accelerator=CPU)
    assert [offload.should_offload(i) for i in range(4)] == [False, True, True, False]
    used = []  # (layer, host buffer address) of every offload, in order
    original_offload = offload.offload

    def recording_offload(layer_idx, tensor):
        handle = original_offload(layer_idx, tensor)
        used.append((layer_idx, handle.host_buffer.data_ptr()))
        return handle

    offload.offload = recording_offload
    x = torch.randn(3, 7, 16, requires_grad=True)
    per_layer = x.numel() * x.element_size()
    for _step in range(2):
        offload.reset_peak()
        out = _run(blocks, x, "checkpoint", offload)
        assert offload.host_bytes_in_use == 2 * per_layer
        out.sum().backward()
        assert offload.host_bytes_in_use == 0
        assert offload.host_bytes_peak == 2 * per_layer
    # Steady state: the second step reused the first step's two buffers, nothing new.
    assert offload.buffers_allocated == 2
    assert offload.host_bytes_reserved == 2 * per_layer
    assert [layer for layer, _ in used] == [1, 2, 1, 2]
    first_step, second_step = {ptr for _, ptr in used[:2]}, {ptr for _, ptr in used[2:]}
    assert len(first_step) == 2 and first_step == second_step


def test_offload_fetch_prefetch_roundtrip_and_errors():
    offload = OffloadScheduler(3, keep_last=1, accelerator="cpu")
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    ha, hb = offload.offload(0, a), offload.offload(1, b)
    assert offload.host_bytes_in_use == 2 * a.numel() * 4
    offload.prefetch(0)
    offload.prefetch(2)  # nothing offloaded there: no-op
    offload.prefetch(-1)  # before the first layer: no-op
    assert torch.equal(offload.fetch(hb), b) and torch.equal(offload.fetch(ha), a)
    assert offload.host_bytes_in_use == 0 and offload.host_bytes_peak == 2 * a.numel() * 4
    with pytest.raises(RuntimeError, match="layer 1 was already fetched"):
        offload.fetch(hb)
    offload.offload(1, b)
    offload.release_all()
    assert offload.host_bytes_in_use == 0 and offload.buffers_allocated == 2
    with pytest.raises(ValueError, match=r"layer_idx=3 outside \[0, 3\)"):
        offload.should_offload(3)
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        OffloadScheduler(0, accelerator="cpu")
    with pytest.raises(ValueError, match="keep_last=-1"):
        OffloadScheduler(2, keep_last=-1, accelerator="cpu")


def test_prefetch_off_brings_inputs_back_only_on_fetch():
    offload = OffloadScheduler(3, keep_last=1, accelerator="cpu", prefetch=False)
    a = torch.randn(4, 5)
    handle = offload.offload(0, a)
    offload.prefetch(0)
    assert handle.on_accelerator is None  # nothing brought back ahead of need
    assert torch.equal(offload.fetch(handle), a)


class RecordingBlock(Block):
    """A Block that keeps a weak reference to every output it computes with grad enabled (the recompute)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.outputs = []

    def forward(self, x):
        y = super().forward(x)
        if torch.is_grad_enabled():
            self.outputs.append(weakref.ref(y))
        return y


def test_recomputed_block_output_is_freed_before_its_backward():
    torch.manual_seed(0)
    block = RecordingBlock(16, 48)
    x = torch.randn(64, 16, requires_grad=True)
    alive_during_backward = []
    block.down.weight.register_post_accumulate_grad_hook(
        lambda _: alive_during_backward.append(block.outputs[-1]() is not None))
    checkpoint_block(block, x).sum().backward()
    # The residual add's output is needed by nobody: it is gone before the block's backward runs.
    assert len(block.outputs) == 1 and alive_during_backward == [False]


def test_block_whose_last_op_saves_its_output_keeps_it_and_stays_exact():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)

    def block(x):
        return torch.exp(lin(x) * 0.1)  # ExpBackward reads the output itself

    x = torch.randn(8, 16, requires_grad=True)
    block(x).sum().backward()
    want_x, want_w = x.grad.clone(), lin.weight.grad.clone()
    x.grad, lin.weight.grad = None, None
    checkpoint_block(block, x).sum().backward()
    _assert_rel_close(x.grad, want_x, 1e-6)
    _assert_rel_close(lin.weight.grad, want_w, 1e-6)


def test_second_backward_through_offloaded_block_is_a_clear_error():
    blocks = _stack(num_blocks=2)
    offload = OffloadScheduler(2, keep_last=1, accelerator=CPU)
    out = _run(blocks, torch.randn(4, 16, requires_grad=True), "checkpoint", offload)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="layer 0's offloaded input was consumed"):
        out.sum().backward()


class _PageLockRecorder:
    """Stands in for cudaHostRegister/Unregister: records (address, bytes) of each call."""

    def __init__(self, monkeypatch):
        from megatron_lc.memory import offload as offload_module

        self.locked, self.unlocked = [], []
        monkeypatch.setattr(offload_module, "page_lock", lambda t: self.locked.append(
            (t.data_ptr(), t.numel() * t.element_size())))
        monkeypatch.setattr(offload_module, "page_unlock", lambda t: self.unlocked.append(t.data_ptr()))


def test_arena_page_locks_exactly_the_offloaded_inputs_once(monkeypatch, caplog):
    """One exact allocation per (shape, dtype): the bytes of the offloaded layers' inputs, never rounded
    up (torch's pinned allocator would round 3*7*16*4 = 1344 bytes per input up to 2048), locked once."""
    recorder = _PageLockRecorder(monkeypatch)
    blocks = _stack(num_blocks=6)
    offload = OffloadScheduler(6, keep_last=1, keep_first=1, accelerator=CPU, page_locked=True)
    x = torch.randn(3, 7, 16, requires_grad=True)
    per_layer = x.numel() * x.element_size()
    caplog.set_level("INFO", logger="megatron_lc.memory.offload")
    offload.reserve(offload.input_arena(x.shape, x.dtype))  # before the first step: nothing is locked on its critical path
    assert recorder.locked == [(recorder.locked[0][0], 4 * per_layer)]
    assert f"page-locking {4 * per_layer:,} bytes" in caplog.text
    used = []
    original = offload.offload
    offload.offload = lambda i, t: used.append(original(i, t)) or used[-1]
    want = _run(blocks, x, "plain")
    for _step in range(2):
        out = _run(blocks, x, "checkpoint", offload)
        start = recorder.locked[0][0]
        assert all(start <= h.host_buffer.data_ptr() < start + 4 * per_layer for h in used[-4:])
        out.sum().backward()
        torch.testing.assert_close(out, want)
    assert len(recorder.locked) == 1 and offload.host_bytes_reserved == offload.page_locked_bytes == 4 * per_layer
    assert len({h.layer_idx for h in used}) == 4 and offload.buffers_allocated == 4
    offload.close()
    assert recorder.unlocked == [recorder.locked[0][0]] and offload.page_locked_bytes == 0


def test_arena_of_a_new_shape_replaces_an_idle_one(monkeypatch):
    recorder = _PageLockRecorder(monkeypatch)
    offload = OffloadScheduler(3, keep_last=1, accelerator=CPU, page_locked=True)
    a = torch.randn(4, 5)
    offload.fetch(offload.offload(0, a))
    b = torch.randn(8, 5)  # e.g. evaluation at another length: the idle (4, 5) arena is unlocked first
    handle = offload.offload(0, b)
    assert recorder.unlocked == [recorder.locked[0][0]] and recorder.locked[1][1] == 2 * b.numel() * 4
    assert offload.host_bytes_reserved == 2 * b.numel() * 4
    assert torch.equal(offload.fetch(handle), b)
    offload.offload(0, b), offload.offload(1, b)
    offload.offload(2, b)  # a third in flight where two layers offload: one more slot, not a failure
    assert offload.host_bytes_reserved == 3 * b.numel() * 4


def test_arenas_reserved_together_stay_and_a_shape_nobody_reserved_is_made_in_the_step_with_a_warning(
        monkeypatch, caplog):
    """`reserve` makes every arena it is given (the later ones do not evict the earlier, idle ones); a tensor of
    another shape still finds an arena, made (and page-locked) in the step, with one warning naming it, and the
    reserved arenas stay."""
    from megatron_lc.memory.kept_attention import ATTENTION_KIND

    recorder = _PageLockRecorder(monkeypatch)
    offload = OffloadScheduler(3, keep_last=1, accelerator=CPU, page_locked=True)
    arenas = {**offload.input_arena((4, 5), torch.float32), ((4, 2, 3), torch.float32, ATTENTION_KIND): 2,
              ((2, 4), torch.float32, ATTENTION_KIND): 2}
    offload.reserve(arenas)
    assert offload.arena_slots() == arenas and len(recorder.locked) == 3
    offload.offload(0, torch.randn(4, 2, 3), kind=ATTENTION_KIND, slots=2)
    assert len(recorder.locked) == 3  # reserved: nothing made
    caplog.set_level("WARNING", logger="megatron_lc.memory.offload")
    offload.offload(0, torch.randn(2, 5), kind=ATTENTION_KIND, slots=2)
    assert len(recorder.locked) == 4 and recorder.locked[-1][1] == 2 * 10 * 4
    assert recorder.unlocked == [] and offload.arena_slots().keys() >= arenas.keys()  # the idle reserved ones stay
    assert caplog.text.count("were not reserved before the first step") == 1 and "[2, 5]" in caplog.text


def test_arenas_are_not_page_locked_off_cuda_by_default(monkeypatch):
    recorder = _PageLockRecorder(monkeypatch)
    offload = OffloadScheduler(3, keep_last=1, accelerator=CPU)
    offload.offload(0, torch.randn(4, 5))
    assert recorder.locked == [] and offload.page_locked_bytes == 0 and offload.host_bytes_reserved == 2 * 80


def test_a_locked_arena_starts_on_a_page_boundary(monkeypatch):
    """cudaHostRegister locks whole pages: an arena must not share one with other memory."""
    import mmap

    recorder = _PageLockRecorder(monkeypatch)
    offload = OffloadScheduler(3, keep_last=1, accelerator=CPU, page_locked=True)
    t = torch.randn(5, 3)  # 60 bytes: a heap allocation, not page-aligned by itself
    assert torch.equal(offload.fetch(offload.offload(0, t)), t)
    start, nbytes = recorder.locked[0]
    assert start % mmap.PAGESIZE == 0 and nbytes == 2 * 60


# --- host arenas at exit, after a failed registration, and page-locking in pieces -------------------


def _unraisable(monkeypatch) -> list:
    """Exceptions raised in destructors (Python only prints them): recorded instead."""
    import sys

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: seen.append(info.exc_value))
    return seen


def _arena_with(lock, unlock):
    from megatron_lc.memory.offload import HostArena

    return HostArena((4, 8), torch.float32, 2, CPU, lock, unlock)


def test_arena_is_not_unlocked_at_interpreter_exit_and_its_destructor_never_raises(monkeypatch):
    """At exit CUDA may be torn down before the arena goes: unlocking then fails, and would raise in __del__."""
    import gc
    import sys

    seen = _unraisable(monkeypatch)
    unlocked = []

    def unlock(t):
        unlocked.append(t.data_ptr())
        raise RuntimeError("cudaHostUnregister failed with cudaError 4")  # cudaErrorCudartUnloading

    arena = _arena_with(lambda t: None, unlock)
    monkeypatch.setattr(sys, "is_finalizing", lambda: True)
    del arena
    gc.collect()
    assert unlocked == [] and seen == []


def test_arena_whose_unlock_fails_reports_it_instead_of_raising_from_its_destructor(monkeypatch, caplog):
    import gc

    seen = _unraisable(monkeypatch)
    arena = _arena_with(lambda t: None, lambda t: (_ for _ in ()).throw(RuntimeError("cudaError 1")))
    with caplog.at_level("WARNING"):
        del arena
        gc.collect()
    assert seen == [] and "unlocking a host arena" in caplog.text


def test_arena_whose_registration_failed_never_unlocks(monkeypatch):
    """A failed cudaHostRegister leaves nothing registered: unregistering it later would fail in __del__."""
    import gc

    seen = _unraisable(monkeypatch)
    unlocked = []

    def lock(t):
        raise RuntimeError("cudaHostRegister failed")

    with pytest.raises(RuntimeError, match="cudaHostRegister failed"):
        _arena_with(lock, lambda t: unlocked.append(t.data_ptr()))
    gc.collect()
    assert unlocked == [] and seen == []


class _FakeCudart:
    """cudaHostRegister/Unregister that record their calls; registration fails from call `fail_at` on."""

    def __init__(self, fail_at=None):
        self.registered, self.unregistered, self.fail_at = [], [], fail_at

    def cudaHostRegister(self, address, nbytes, flags):
        if self.fail_at is not None and len(self.registered) >= self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((address, nbytes))
        return 0

    def cudaHostUnregister(self, address):
        self.unregistered.append(address)
        return 0


def test_page_lock_registers_large_arenas_in_pieces_and_undoes_a_failed_one(monkeypatch):
    """R580+ drivers refuse single registrations of about 512 GiB or more: pieces of at most PAGE_LOCK_PIECE."""
    from megatron_lc.memory import offload as offload_module

    monkeypatch.setattr(offload_module, "PAGE_LOCK_PIECE", 4096)
    buffer = torch.empty(10_000, dtype=torch.uint8)
    start = buffer.data_ptr()
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    offload_module.page_lock(buffer)
    assert cudart.registered == [(start, 4096), (start + 4096, 4096), (start + 8192, 10_000 - 8192)]
    offload_module.page_unlock(buffer)
    assert cudart.unregistered == [start, start + 4096, start + 8192]

    cudart = _FakeCudart(fail_at=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with pytest.raises(RuntimeError, match="host RAM exhausted or registration too large") as error:
        offload_module.page_lock(buffer)
    assert "ulimit" not in str(error.value) and "smaller pieces" in str(error.value)
    assert cudart.unregistered == [start, start + 4096], "the pieces registered before the failure are undone"


def test_sparse_offload_policy_segments_and_refetch():
    """keep_first 1, keep_last 1, k 3 over 9 layers: layers 1-7 offload in segments {1, 2, 3}, {4, 5, 6}, {7}."""
    offload = OffloadScheduler(9, keep_last=1, keep_first=1, accelerator=CPU, every_k=3)
    assert [offload.segment_start(i) for i in range(9)] == [0, 1, 1, 1, 4, 4, 4, 7, 8]
    assert [offload.segment_end(i) for i in range(9)] == [1, 4, 4, 4, 7, 7, 7, 8, 9]
    assert [offload.keeps_input(i) for i in range(9)] == [True, True, False, False, True, False, False, True, True]
    assert offload.offloaded_layers == 7 and offload.host_slots == 3
    a = torch.randn(4, 5)
    handle = offload.offload(4, a)
    offload.prefetch(6)  # layer 6's backward starts from layer 4's input
    assert handle.on_accelerator is not None
    assert torch.equal(offload.fetch(handle, keep=True), a) and offload.host_bytes_in_use == a.numel() * 4
    assert handle.on_accelerator is None  # a later prefetch copies it back again
    assert torch.equal(offload.fetch(handle, keep=True), a)
    assert torch.equal(offload.fetch(handle), a) and offload.host_bytes_in_use == 0
    with pytest.raises(ValueError, match="every_k must be >= 1"):
        OffloadScheduler(2, accelerator=CPU, every_k=0)


def test_sparse_offload_second_backward_is_a_clear_error():
    blocks = _stack(num_blocks=3)
    offload = OffloadScheduler(3, keep_last=1, accelerator=CPU, every_k=2)
    out = _run(blocks, torch.randn(4, 16, requires_grad=True), "checkpoint", offload)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="layer 0's offloaded input was consumed"):
        out.sum().backward()


class _FailsOnce(nn.Module):
    """A block whose first recompute (in backward) raises, as an out-of-memory error would."""

    def __init__(self, block):
        super().__init__()
        self.block, self.armed, self.calls = block, False, 0

    def forward(self, x):
        self.calls += 1
        if self.armed and torch.is_grad_enabled():
            self.armed = False
            raise RuntimeError("CUDA out of memory (stand-in)")
        return self.block(x)


@pytest.mark.parametrize("early", [False, True])
def test_a_backward_that_raises_leaves_no_offloaded_tensor_behind_and_the_next_step_is_exact(early):
    torch.manual_seed(0)
    blocks = nn.ModuleList(_FailsOnce(Block(16, 32)) for _ in range(4))
    x = torch.randn(64, 16, requires_grad=True)
    offload = OffloadScheduler(4, keep_last=1, accelerator=CPU, prefetch=True, prefetch_early=early)

    def step():
        y = x
        for i, block in enumerate(blocks):
            y = checkpoint_block(block, y, offload=offload, layer_idx=i)
        y.square().sum().backward()

    blocks[1].armed = True  # layer 2's backward prefetched layer 1's input (early) before layer 1 raises
    with pytest.raises(RuntimeError, match="out of memory"):
        step()
    assert offload.host_bytes_in_use == 0 and not any(offload._pending.values())
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    step()
    got = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    y = x
    for block in blocks:
        y = block(y)
    y.square().sum().backward()
    for g, w in zip(got, [p.grad for p in blocks.parameters()] + [x.grad]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_release_waits_for_the_side_stream_before_dropping_copies_in_flight():
    """CUDA's contract: memory a side-stream copy writes may go back to the allocator only after the copy; the
    scheduler synchronizes its copy stream before dropping a prefetched tensor (a recording stand-in stream)."""
    offload = OffloadScheduler(3, keep_last=1, accelerator=CPU)
    handles = [offload.offload(i, torch.randn(4, 4)) for i in range(2)]
    offload.prefetch(1)  # on CPU the copy is done at once; on CUDA it would be in flight on the side stream
    in_flight = [h for h in handles if h.on_accelerator is not None]
    assert in_flight

    class Stream:
        synchronized_with = None

        def synchronize(self):
            self.synchronized_with = [h.on_accelerator is not None for h in in_flight]

    offload._is_cuda, offload._copy_stream = True, Stream()
    offload.release_all()
    assert offload._copy_stream.synchronized_with == [True] * len(in_flight)  # still held when it synchronized
    assert all(h.on_accelerator is None and h.host_buffer is None for h in handles)
