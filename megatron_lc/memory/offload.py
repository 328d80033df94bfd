"""Offload scheduler: moves kept block inputs to host memory and brings them back.

On CUDA, copies run on one side stream, ordered against the compute stream with
``wait_stream`` / events, into page-locked host buffers, so they overlap compute.

Host memory is exact-size. torch's caching host allocator (``pin_memory=True``) rounds
every request up to a power of two (``CachingHostAllocator.h``: ``roundSize``), so a 5
GiB block input (Llama3-8B, 5,242,880 tokens on 8 GPUs) would pin 8 GiB. Instead the
scheduler keeps one *arena* per (shape, dtype): a single ordinary host allocation of
exactly ``slots x bytes`` (slots = the layers that offload), page-locked once with
``cudaHostRegister`` (in pieces of at most 256 GiB: larger single registrations fail on
R580+ drivers) and carved into one view per slot. Arenas are made before the first step by
``reserve`` (the memory stack names every arena a step fills, `MemoryStack.host_arenas`;
page-locking a terabyte takes minutes, and inside step 1 it would stall it; each arena is logged
with its byte count), else the first time a shape is offloaded (with a warning once anything was
reserved). In steady state every step reuses the same slots and nothing is allocated. All copies
in both directions run on the same side stream, which is what makes reuse safe: a slot returned
after its copy back was *queued* can only be overwritten by a later copy on that same stream,
i.e. after the copy back has run.

On any other accelerator (cpu in tests) the same code path runs with plain, synchronous
copies into the arenas' slots, so the byte accounting is exercised too.

Sparse offload (``every_k`` > 1): the offloaded layers are cut into segments of ``every_k``
consecutive layers, and only each segment's first layer keeps its input (one host slot per
segment); the others keep nothing and ``memory/recompute.py`` recomputes their input from the
segment's kept one. Such a kept input is fetched once per layer of its segment: ``fetch(handle,
keep=True)`` copies it back and leaves the host slot in place, the last (its own layer's) fetch
releases it. ``prefetch(i)`` brings back the input layer ``i``'s backward starts from: its
segment's kept one.

Other tensors a layer keeps for its backward (``kind``: the attention output and log-sum-exp of
``--keep-attention-output``, `memory/kept_attention.py`) go through the same copies, in arenas of
their own kind (one slot per offloaded layer and tensor of that shape), and ``prefetch(i)`` brings
back layer ``i``'s own with its input.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import mmap
import sys
import time
from dataclasses import dataclass

import torch

LOG = logging.getLogger(__name__)
_CUDA_HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable: the memory counts as page-locked for every CUDA context (as torch's own use)."""


INPUT_KIND = "input"
"""The kind of a layer's kept block input (other kinds: other tensors a layer keeps for its backward)."""

ArenaKey = tuple[tuple[int, ...], torch.dtype, str]
"""An arena's (shape, dtype, kind): one arena per key, of one slot per tensor of that key on the host at once."""

PAGE_LOCK_PIECE = 256 << 30
"""Bytes page-locked by one cudaHostRegister at most: on R580 and later drivers a single registration of
about 512 GiB or more fails, so larger arenas are registered in pieces."""


def _pieces(buffer: torch.Tensor) -> list[tuple[int, int]]:
    """(address, bytes) of each registration `page_lock` makes for `buffer`."""
    start, nbytes = buffer.data_ptr(), _nbytes(buffer)
    return [(start + offset, min(PAGE_LOCK_PIECE, nbytes - offset)) for offset in range(0, nbytes, PAGE_LOCK_PIECE)]


def page_lock(buffer: torch.Tensor) -> None:
    """Page-lock an ordinary host tensor's memory in place (cudaHostRegister, in pieces of at most
    `PAGE_LOCK_PIECE` bytes), for asynchronous copies. On failure nothing stays registered."""
    cudart = torch.cuda.cudart()
    done, pieces, began = [], _pieces(buffer), time.monotonic()
    for address, nbytes in pieces:
        error = int(cudart.cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
        if error != 0:
            for registered, _ in done:
                cudart.cudaHostUnregister(registered)
            raise RuntimeError(
                f"cudaHostRegister of {nbytes:,} bytes (of an arena of {_nbytes(buffer):,}) failed with cudaError "
                f"{error}: host RAM exhausted or registration too large (the memlock limit does not apply; "
                f"a single registration of about 512 GiB or more fails on R580+ drivers: register in smaller "
                f"pieces, megatron_lc uses {PAGE_LOCK_PIECE >> 30} GiB)")
        done.append((address, nbytes))
        if len(pieces) > 1:  # one driver call per piece: progress between them
            locked = sum(n for _, n in done)
            LOG.info("offload: page-locked %.0f of %.0f GiB (%d of %d pieces), %.0f s", locked / 2**30,
                     _nbytes(buffer) / 2**30, len(done), len(pieces), time.monotonic() - began)


def page_unlock(buffer: torch.Tensor) -> None:
    """Undo `page_lock` (cudaHostUnregister of each piece)."""
    cudart = torch.cuda.cudart()
    for address, _ in _pieces(buffer):
        error = int(cudart.cudaHostUnregister(address))
        if error != 0:
            raise RuntimeError(f"cudaHostUnregister failed with cudaError {error}")


_EXITING = False
"""Set when the interpreter starts to exit: from then on arenas are not unlocked (see `HostArena.__del__`)."""


@atexit.register
def _note_exit() -> None:  # registered after torch's own exit handlers, so it runs before them
    global _EXITING
    _EXITING = True


def _page_aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` bytes starting on a page boundary, the pages up to the next boundary ours alone."""
    raw = torch.empty(nbytes + 2 * mmap.PAGESIZE, dtype=torch.uint8, device=device)
    start = -raw.data_ptr() % mmap.PAGESIZE
    return raw[start:start + nbytes]


class ExactHostBuffers:
    """Host tensors of the given shapes (one dtype), carved from one allocation of exactly their bytes.

    ``lock``/``unlock`` page-lock the allocation (None: ordinary memory): one registration of exactly
    ``nbytes``, where ``pin_memory=True`` would round each tensor up to a power of two. The views share
    the allocation's storage, so a memory tracker sees one buffer of exactly their bytes. A locked
    allocation starts on a page boundary inside one two pages longer, so no page it locks is shared with
    other memory (locking a page twice fails). The offload arenas and the host optimizer's master weights,
    gradient buffers and staging are all made this way.
    """

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                 lock=None, unlock=None) -> None:
        numels = [math.prod(shape) for shape in shapes]
        total = sum(numels)
        self.nbytes = total * dtype.itemsize
        self._storage = torch.empty(total, dtype=dtype, device=device) if lock is None \
            else _page_aligned(self.nbytes, device).view(dtype)
        self._unlock = None  # set once the lock holds: a failed registration has nothing to undo
        if lock is not None and self.nbytes:
            lock(self._storage)
            self._unlock = unlock
        starts = itertools.accumulate(numels, initial=0)
        self.views = [self._storage[start:start + n].view(shape) for start, n, shape in zip(starts, numels, shapes)]

    @property
    def page_locked(self) -> bool:
        return self._unlock is not None

    def close(self) -> None:
        """Unlock and drop the allocation (no view may be in use)."""
        if self._unlock is not None and self._storage is not None:
            self._unlock(self._storage)
        self._storage, self.views = None, []

    def __del__(self) -> None:
        # Freed memory left registered would make a later registration of the same pages fail. At
        # interpreter exit the registrations go with the process, and CUDA (or torch.cuda) may already be
        # torn down: nothing is unlocked then. A destructor must not raise either way.
        if getattr(self, "_storage", None) is None or _EXITING or sys.is_finalizing():
            return
        try:
            self.close()
        except Exception as error:  # noqa: BLE001 - reported, never raised from a destructor
            LOG.warning("unlocking a host arena of %s bytes failed: %s", f"{self.nbytes:,}", error)


class HostArena(ExactHostBuffers):
    """``slots`` host buffers of one shape and dtype, carved from one exact allocation (`ExactHostBuffers`)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, slots: int, device: torch.device,
                 lock=None, unlock=None) -> None:
        super().__init__([tuple(shape)] * slots, dtype, device, lock, unlock)
        self.free = list(self.views)
        self.slots = slots

    @property
    def idle(self) -> bool:
        """No slot is in use."""
        return len(self.free) == self.slots

    def close(self) -> None:
        """Unlock and drop the allocation (every slot must be free)."""
        super().close()
        self.free = []


@dataclass(eq=False)
class OffloadHandle:
    """One offloaded tensor: where it lives on the host and, once prefetched, its copy back."""

    layer_idx: int
    host_buffer: torch.Tensor | None
    arena: HostArena | None = None
    key: object = None
    """Where the scheduler lists it until fetched: the layer (block inputs), or (kind, layer)."""
    to_host_done: object | None = None  # torch.cuda.Event on CUDA
    on_accelerator: torch.Tensor | None = None
    to_accelerator_done: object | None = None


def arena_bytes(arenas: dict[ArenaKey, int]) -> int:
    """Host bytes of these arenas (key -> slots), as `OffloadScheduler.reserve` allocates them."""
    return sum(slots * math.prod(shape) * dtype.itemsize for (shape, dtype, _), slots in arenas.items())


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


class OffloadScheduler:
    """Decides which layers offload their kept input, owns the host arenas, counts bytes.

    Layers ``[keep_first, num_layers - keep_last)`` offload; the first ``keep_first`` and
    the last ``keep_last`` keep their input on the accelerator (the last layers' inputs
    are needed first in backward, so offloading them buys nothing).

    Args:
        num_layers: transformer blocks in the model.
        keep_last, keep_first: layers at each end that stay on the accelerator.
        accelerator: where activations live and come back to (cuda, or cpu in tests).
        host: where offloaded activations live (cpu; page-locked when the accelerator is cuda).
        prefetch: start bringing a layer's input back when the next layer's backward has
            passed its memory peak (the copy overlaps the hand-off between the layers and costs
            no memory at the peak); False: fetch each input only when its own layer's
            backward needs it.
        prefetch_early: with prefetch, start that copy when the next layer's backward starts
            instead (``memory/recompute.py`` asks then): the side stream waits only for the
            compute queued before that backward, so the copy runs during it, at the cost of one
            more block input on the accelerator through its peak. Without it the copy waits for the
            whole backward queued before it and the layer that needs it waits for the copy.
        page_locked: page-lock the arenas (default: when the accelerator is cuda and the host cpu).
        every_k: keep the input of every k-th offloaded layer only (the first of each segment of k);
            the others are recomputed from it in backward (1: every offloaded layer keeps its input).
        attention_layers: the offloaded layers that keep their attention output (the first ones; None: all).
        replay_kept_attention: with every_k > 1, the layers a segment replays to rebuild its inputs read their
            kept attention output instead of computing it (`memory/recompute.py`).
    """

    def __init__(
        self,
        num_layers: int,
        *,
        keep_last: int = 1,
        keep_first: int = 0,
        accelerator: torch.device | str,
        host: torch.device | str = "cpu",
        prefetch: bool = True,
        prefetch_early: bool = False,
        page_locked: bool | None = None,
        every_k: int = 1,
        attention_layers: int | None = None,
        replay_kept_attention: bool = False,
    ) -> None:
        if every_k < 1:
            raise ValueError(f"every_k must be >= 1, got {every_k}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if keep_last < 0 or keep_first < 0:
            raise ValueError(f"keep_last={keep_last} and keep_first={keep_first} must be >= 0")
        self.num_layers, self.keep_last, self.keep_first = num_layers, keep_last, keep_first
        self.every_k = every_k
        self._attention_layers = attention_layers
        self.replay_kept_attention = replay_kept_attention
        if prefetch_early and not prefetch:
            raise ValueError("prefetch_early needs prefetch")
        self.prefetch_enabled, self.prefetch_early = prefetch, prefetch_early
        self.accelerator, self.host = torch.device(accelerator), torch.device(host)
        self._is_cuda = self.accelerator.type == "cuda"
        self._pin = (self._is_cuda and self.host.type == "cpu") if page_locked is None else page_locked
        self._copy_stream = torch.cuda.Stream(device=self.accelerator) if self._is_cuda else None
        self._arenas: dict[ArenaKey, list[HostArena]] = {}
        self._reserved: frozenset[ArenaKey] = frozenset()
        """The keys of the last `reserve`: a step keeps their arenas even when idle."""
        self._pending: dict[object, list[OffloadHandle]] = {}
        self.host_bytes_in_use = 0
        self.host_bytes_peak = 0
        self.host_bytes_reserved = 0
        self.buffers_allocated = 0

    # ------------------------------------------------------------------ policy and stats

    def should_offload(self, layer_idx: int) -> bool:
        """Whether ``layer_idx``'s kept input goes to the host."""
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={layer_idx} outside [0, {self.num_layers})")
        return self.keep_first <= layer_idx < self.num_layers - self.keep_last

    def segment_start(self, layer_idx: int) -> int:
        """The layer whose kept input ``layer_idx``'s backward starts from: the first of its segment of
        ``every_k`` offloaded layers (itself outside the offloaded range, or with every_k = 1)."""
        if not self.should_offload(layer_idx):
            return layer_idx
        return self.keep_first + (layer_idx - self.keep_first) // self.every_k * self.every_k

    def segment_end(self, layer_idx: int) -> int:
        """One past the last layer of ``layer_idx``'s segment."""
        if not self.should_offload(layer_idx):
            return layer_idx + 1
        return min(self.segment_start(layer_idx) + self.every_k, self.num_layers - self.keep_last)

    def keeps_input(self, layer_idx: int) -> bool:
        """Whether ``layer_idx`` keeps its input (on the host or the accelerator); False: recomputed."""
        return self.segment_start(layer_idx) == layer_idx

    @property
    def offloaded_layers(self) -> int:
        """Layers in the offloaded range (with sparse offload, only one per segment keeps its input)."""
        return max(0, self.num_layers - self.keep_last - self.keep_first)

    @property
    def attention_layers(self) -> int:
        """Offloaded layers that keep their attention output on the host (`--keep-attention-output-layers`):
        the slots of each kept-attention arena."""
        every = self.offloaded_layers
        return every if self._attention_layers is None else min(self._attention_layers, every)

    @property
    def host_slots(self) -> int:
        """Block inputs on the host at once: one per segment of the offloaded range, the slots of each arena."""
        return -(-self.offloaded_layers // self.every_k)

    @property
    def page_locked_bytes(self) -> int:
        """Host bytes page-locked now (0 when the arenas are ordinary memory)."""
        return self.host_bytes_reserved if self._pin else 0

    def arena_slots(self) -> dict[ArenaKey, int]:
        """Every arena made so far, with its slots."""
        return {key: sum(a.slots for a in arenas) for key, arenas in self._arenas.items()}

    def host_buffers(self) -> list[torch.Tensor]:
        """Every host slot of every arena made so far (free or in use)."""
        return [view for arenas in self._arenas.values() for arena in arenas for view in arena.views]

    def input_arena(self, shape: tuple[int, ...], dtype: torch.dtype) -> dict[ArenaKey, int]:
        """The arena of block inputs of this shape and dtype, with its slots (one per kept offloaded input)."""
        return {(tuple(shape), dtype, INPUT_KIND): max(1, self.host_slots)}

    def reserve(self, arenas: dict[ArenaKey, int]) -> None:
        """Make these arenas (key -> slots) now, before the first step needs them: a step that offloads only
        tensors of these keys then allocates and page-locks nothing. Idle arenas of other keys go first."""
        self._reserved = frozenset(key for key, slots in arenas.items() if slots)
        for key, slots in arenas.items():
            if slots and not self._arenas.get(key):
                self._new_arena(key, slots)

    def reset_peak(self) -> None:
        """Restart peak tracking from the bytes in use now (e.g. at each step)."""
        self.host_bytes_peak = self.host_bytes_in_use

    # ------------------------------------------------------------------ host arenas

    def _new_arena(self, key: ArenaKey, slots: int) -> HostArena:
        """One exact allocation for `slots` tensors of `key`, logged; idle arenas of other keys go first (e.g.
        evaluation at another length), but for those reserved."""
        for other, arenas in list(self._arenas.items()):
            if other != key and other not in self._reserved and all(a.idle for a in arenas):
                if self._is_cuda:  # a copy back from a returned slot may still be running
                    self._copy_stream.synchronize()
                for arena in arenas:
                    self.host_bytes_reserved -= arena.nbytes
                    arena.close()
                del self._arenas[other]
        shape, dtype, kind = key
        nbytes = slots * math.prod(shape) * dtype.itemsize
        LOG.info("offload: %s %s bytes (%.2f GiB) of host memory for %d %s %s %s",
                 "page-locking" if self._pin else "allocating", f"{nbytes:,}", nbytes / 2**30, slots,
                 "block inputs" if kind == INPUT_KIND else f"{kind} tensors", list(shape),
                 str(dtype).removeprefix("torch."))
        lock, unlock = (page_lock, page_unlock) if self._pin else (None, None)
        began = time.monotonic()
        arena = HostArena(shape, dtype, slots, self.host, lock, unlock)
        LOG.info("offload: %s %.2f GiB in %.0f s", "page-locked" if self._pin else "allocated", nbytes / 2**30,
                 time.monotonic() - began)
        self._arenas.setdefault(key, []).append(arena)
        self.host_bytes_reserved += arena.nbytes
        self.buffers_allocated += slots
        return arena

    def _acquire(self, shape: torch.Size, dtype: torch.dtype, kind: str = INPUT_KIND,
                 slots: int | None = None) -> tuple[HostArena, torch.Tensor]:
        """A free slot of the (shape, dtype, kind) arena, made on first use with `slots` slots (default: one
        per kept offloaded input)."""
        key = (tuple(shape), dtype, kind)
        arenas = self._arenas.get(key, [])
        arena = next((a for a in arenas if a.free), None)
        if arena is None:
            if arenas:  # more tensors of this shape in flight than layers offload: one more slot
                LOG.warning("offload: more than %d %s tensors of shape %s on the host; adding one slot",
                            sum(a.slots for a in arenas), kind, list(shape))
            elif self._reserved:
                LOG.warning("offload: %s tensors of shape %s %s were not reserved before the first step; their "
                            "arena is made (and page-locked) inside this step", kind, list(shape), dtype)
            arena = self._new_arena(key, 1 if arenas else max(1, self.host_slots if slots is None else slots))
        buffer = arena.free.pop()
        self.host_bytes_in_use += _nbytes(buffer)
        self.host_bytes_peak = max(self.host_bytes_peak, self.host_bytes_in_use)
        return arena, buffer

    def _release(self, arena: HostArena, buffer: torch.Tensor) -> None:
        """Return a slot to its arena (see the module docstring for why this is safe)."""
        self.host_bytes_in_use -= _nbytes(buffer)
        arena.free.append(buffer)

    # ------------------------------------------------------------------ copies

    def _copy_on_side_stream(self, dst: torch.Tensor, src: torch.Tensor):
        """``dst.copy_(src)``, on the side stream after the compute stream's queued work.

        Returns the CUDA event marking the copy's end, or None off CUDA (copy done).
        """
        if not self._is_cuda:
            dst.copy_(src)
            return None
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.accelerator))
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        return done

    def offload(self, layer_idx: int, tensor: torch.Tensor, *, kind: str = INPUT_KIND,
                slots: int | None = None) -> OffloadHandle:
        """Start copying ``tensor`` to a host slot; the caller may drop ``tensor``.

        ``kind``: ``input`` (the layer's kept block input), or another kind of tensor the layer keeps, in
        arenas of its own made with ``slots`` slots (default: one per kept input)."""
        tensor = tensor.detach()
        arena, buffer = self._acquire(tensor.shape, tensor.dtype, kind, slots)
        key = layer_idx if kind == INPUT_KIND else (kind, layer_idx)
        handle = OffloadHandle(layer_idx, buffer, arena, key)
        handle.to_host_done = self._copy_on_side_stream(buffer, tensor)
        if self._is_cuda:
            # Keep the allocator from reusing tensor's memory before the side stream read it.
            tensor.record_stream(self._copy_stream)
        self._pending.setdefault(key, []).append(handle)
        return handle

    def _start_copy_back(self, handle: OffloadHandle) -> None:
        """Queue the host-to-accelerator copy of one handle (no-op if already queued)."""
        if handle.on_accelerator is not None:
            return
        buffer = handle.host_buffer
        # Allocated on the compute stream, which owns it; the side stream waits for that
        # stream's queued work before writing, so reused memory is free by then.
        handle.on_accelerator = torch.empty(
            buffer.shape, dtype=buffer.dtype, device=self.accelerator
        )
        handle.to_accelerator_done = self._copy_on_side_stream(handle.on_accelerator, buffer)

    def prefetch(self, layer_idx: int) -> None:
        """Start bringing back the offloaded input ``layer_idx``'s backward starts from (its own, or with
        sparse offload its segment's kept one), and the other tensors layer ``layer_idx`` itself offloaded;
        no-op if there are none or prefetch is off."""
        if not self.prefetch_enabled or not 0 <= layer_idx < self.num_layers:
            return
        own = [handles for key, handles in self._pending.items() if isinstance(key, tuple) and key[1] == layer_idx]
        for handle in itertools.chain(self._pending.get(self.segment_start(layer_idx), ()), *own):
            self._start_copy_back(handle)

    def fetch(self, handle: OffloadHandle, keep: bool = False) -> torch.Tensor:
        """The offloaded tensor on the accelerator, ready for the compute stream to use.

        ``keep``: the host copy stays (the handle can be fetched again, e.g. by the next layer of a
        sparse-offload segment); otherwise its slot goes back to the arena."""
        if handle.host_buffer is None:
            raise RuntimeError(f"offload handle of layer {handle.layer_idx} was already fetched")
        self._start_copy_back(handle)
        if handle.to_accelerator_done is not None:
            torch.cuda.current_stream(self.accelerator).wait_event(handle.to_accelerator_done)
        if not keep:
            self._forget(handle)
        result, handle.on_accelerator, handle.to_accelerator_done = handle.on_accelerator, None, None
        return result

    def _forget(self, handle: OffloadHandle) -> None:
        """Drop a handle from the pending set and return its host slot to its arena."""
        pending = self._pending.get(handle.key, [])
        if handle in pending:
            pending.remove(handle)
        self._release(handle.arena, handle.host_buffer)
        handle.host_buffer = handle.arena = None

    def release_all(self) -> None:
        """Return every unfetched slot to its arena (after a step without backward, or a backward that raised);
        copies still in flight end first, so no copy writes into memory the allocator handed out again."""
        if self._is_cuda:
            self._copy_stream.synchronize()
        for handles in list(self._pending.values()):
            for handle in list(handles):
                handle.on_accelerator = None
                self._forget(handle)
        self._pending.clear()

    def close(self) -> None:
        """Wait for the copies, then unlock and free every arena (the scheduler is unusable after)."""
        self.release_all()
        for arenas in self._arenas.values():
            for arena in arenas:
                arena.close()
        self._arenas.clear()
        self.host_bytes_reserved = 0
