"""Offload scheduler: moves kept block inputs to host memory and brings them back.

On CUDA, copies run on one side stream, ordered against the compute stream with
``wait_stream`` / events, into pinned host buffers, so they overlap compute. Host
buffers come from a pool keyed by (shape, dtype): in steady state every step reuses
the buffers of the previous one and nothing is allocated. All copies in both
directions run on the same side stream, which is what makes reuse safe: a buffer
returned to the pool after its copy back was *queued* can only be overwritten by a
later copy on that same stream, i.e. after the copy back has run.

On any other accelerator (cpu in tests) the same code path runs with plain, synchronous
copies into pooled host buffers, so the byte accounting is exercised too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class OffloadHandle:
    """One offloaded tensor: where it lives on the host and, once prefetched, its copy back."""

    layer_idx: int
    host_buffer: torch.Tensor | None
    to_host_done: object | None = None  # torch.cuda.Event on CUDA
    on_accelerator: torch.Tensor | None = None
    to_accelerator_done: object | None = None


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


class OffloadScheduler:
    """Decides which layers offload their kept input, owns the host buffer pool, counts bytes.

    Layers ``[keep_first, num_layers - keep_last)`` offload; the first ``keep_first`` and
    the last ``keep_last`` keep their input on the accelerator (the last layers' inputs
    are needed first in backward, so offloading them buys nothing).

    Args:
        num_layers: transformer blocks in the model.
        keep_last, keep_first: layers at each end that stay on the accelerator.
        accelerator: where activations live and come back to (cuda, or cpu in tests).
        host: where offloaded activations live (cpu; pinned when the accelerator is cuda).
        prefetch: bring a layer's input back while the next layer's backward runs (overlaps
            the copy, at the cost of one more block input on the accelerator); False: fetch
            each input only when its own layer's backward needs it.
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
    ) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if keep_last < 0 or keep_first < 0:
            raise ValueError(f"keep_last={keep_last} and keep_first={keep_first} must be >= 0")
        self.num_layers, self.keep_last, self.keep_first = num_layers, keep_last, keep_first
        self.prefetch_enabled = prefetch
        self.accelerator, self.host = torch.device(accelerator), torch.device(host)
        self._is_cuda = self.accelerator.type == "cuda"
        self._pin = self._is_cuda and self.host.type == "cpu"
        self._copy_stream = torch.cuda.Stream(device=self.accelerator) if self._is_cuda else None
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._pending: dict[int, list[OffloadHandle]] = {}
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

    def reset_peak(self) -> None:
        """Restart peak tracking from the bytes in use now (e.g. at each step)."""
        self.host_bytes_peak = self.host_bytes_in_use

    # ------------------------------------------------------------------ buffer pool

    def _acquire(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of this shape and dtype: reused from the pool, else allocated."""
        free = self._free.get((tuple(shape), dtype))
        if free:
            buffer = free.pop()
        else:
            buffer = torch.empty(shape, dtype=dtype, device=self.host, pin_memory=self._pin)
            self.buffers_allocated += 1
            self.host_bytes_reserved += _nbytes(buffer)
        self.host_bytes_in_use += _nbytes(buffer)
        self.host_bytes_peak = max(self.host_bytes_peak, self.host_bytes_in_use)
        return buffer

    def _release(self, buffer: torch.Tensor) -> None:
        """Return a host buffer to the pool (see the module docstring for why this is safe)."""
        self.host_bytes_in_use -= _nbytes(buffer)
        self._free.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)

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

    def offload(self, layer_idx: int, tensor: torch.Tensor) -> OffloadHandle:
        """Start copying ``tensor`` to a pooled host buffer; the caller may drop ``tensor``."""
        tensor = tensor.detach()
        buffer = self._acquire(tensor.shape, tensor.dtype)
        handle = OffloadHandle(layer_idx, buffer)
        handle.to_host_done = self._copy_on_side_stream(buffer, tensor)
        if self._is_cuda:
            # Keep the allocator from reusing tensor's memory before the side stream read it.
            tensor.record_stream(self._copy_stream)
        self._pending.setdefault(layer_idx, []).append(handle)
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
        """Start bringing back ``layer_idx``'s offloaded tensors; no-op if it has none or prefetch is off."""
        if not self.prefetch_enabled:
            return
        for handle in self._pending.get(layer_idx, ()):
            self._start_copy_back(handle)

    def fetch(self, handle: OffloadHandle) -> torch.Tensor:
        """The offloaded tensor on the accelerator, ready for the compute stream to use."""
        if handle.host_buffer is None:
            raise RuntimeError(f"offload handle of layer {handle.layer_idx} was already fetched")
        self._start_copy_back(handle)
        if handle.to_accelerator_done is not None:
            torch.cuda.current_stream(self.accelerator).wait_event(handle.to_accelerator_done)
        self._forget(handle)
        result, handle.on_accelerator = handle.on_accelerator, None
        return result

    def _forget(self, handle: OffloadHandle) -> None:
        """Drop a handle from the pending set and return its host buffer to the pool."""
        pending = self._pending.get(handle.layer_idx, [])
        if handle in pending:
            pending.remove(handle)
        self._release(handle.host_buffer)
        handle.host_buffer = None

    def release_all(self) -> None:
        """Return every unfetched buffer to the pool (after a step without backward)."""
        if self._is_cuda:
            self._copy_stream.synchronize()
        for handles in list(self._pending.values()):
            for handle in list(handles):
                handle.on_accelerator = None
                self._forget(handle)
        self._pending.clear()
