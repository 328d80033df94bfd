"""Micro-batches for one (data-parallel, context-parallel) rank, resumable exactly.

Step `k` covers samples `[k*B*dp, (k+1)*B*dp)` of the sample source; data-parallel
rank `r` takes its `B` consecutive samples from `k*B*dp + r*B`, and context-parallel
rank `c` receives only its `S/cp` tokens of each (see `context_layout`). The state is the number of samples
consumed by all data-parallel ranks together, as in Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from megatron_lc.data.samples import Sample, SampleSource, cp_ranges


@dataclass
class Batch:
    """A micro-batch: int64 tensors of shape `[B, S/cp]`, and the boundaries of the attention
    segments of the whole flattened batch, `(0, ..., S, ..., B*S)` (sample `b` offset by `b*S`):
    each document of a sample with `reset_attention_mask`, else each whole sample (Megatron's default)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: tuple[int, ...]

    @property
    def max_seqlen(self) -> int:
        """Length of the longest attention segment in the batch."""
        return int(np.diff(self.cu_seqlens).max())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """The same batch with its tensors on `device`."""
        move = lambda tensor: tensor.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(move(self.input_ids), move(self.labels), move(self.position_ids), self.cu_seqlens)


def collate(samples: Sequence[Sample], seq_length: int, reset_attention_mask: bool = False) -> Batch:
    """Stack samples into a batch; attention segments are each sample's documents (`reset_attention_mask`)
    or each whole sample, attending across its end-of-document tokens as Megatron does without the flag."""
    cu_seqlens = [0]
    for b, sample in enumerate(samples):
        boundaries = sample.cu_seqlens[1:] if reset_attention_mask else (seq_length,)
        cu_seqlens.extend(b * seq_length + boundary for boundary in boundaries)
    stack = lambda name: torch.from_numpy(np.stack([getattr(s, name) for s in samples]))  # noqa: E731
    return Batch(stack("input_ids"), stack("labels"), stack("position_ids"), tuple(cu_seqlens))


class MicroBatchLoader:
    """Iterates micro-batches of `micro_batch_size` samples for one rank.

    Stops after `num_samples` samples (all data-parallel ranks together) when given,
    otherwise runs as long as it is asked (samples continue into further epochs).
    """

    def __init__(
        self,
        samples: SampleSource,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        cp_rank: int = 0,
        cp_size: int = 1,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
        eod_token: int | None = None,
        num_samples: int | None = None,
        cp_ring: int = 1,
        cp_documents: str = "sequence",
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not a rank of a data-parallel group of size {dp_size}")
        if eod_mask_loss and eod_token is None:
            raise ValueError("eod_mask_loss needs eod_token (the tokenizer's EOD id)")
        cp_ranges(samples.seq_length, cp_rank, cp_size, cp_ring)  # fails early on a bad cp layout
        self.samples = samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cp_rank, self.cp_size, self.cp_ring = cp_rank, cp_size, cp_ring
        # A ring cuts by documents only where attention sees them (as `collate` gives the model its segments).
        self.cp_documents = cp_documents if reset_attention_mask else "sequence"
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.eod_mask_loss = eod_mask_loss
        self.eod_token = eod_token
        self.num_samples = num_samples
        self.consumed_samples = 0

    @property
    def samples_per_step(self) -> int:
        """Samples consumed by one step over all data-parallel ranks."""
        return self.micro_batch_size * self.dp_size

    def __iter__(self) -> "MicroBatchLoader":
        return self

    def __next__(self) -> Batch:
        if self.num_samples is not None and self.consumed_samples + self.samples_per_step > self.num_samples:
            raise StopIteration
        batch = self.micro_batch(self.consumed_samples // self.samples_per_step)
        self.consumed_samples += self.samples_per_step
        return batch

    def micro_batch(self, step: int) -> Batch:
        """This rank's micro-batch of step `step` (its samples from `step * micro_batch_size * dp_size`)."""
        first = step * self.samples_per_step + self.dp_rank * self.micro_batch_size
        return collate([self._sample(first + b) for b in range(self.micro_batch_size)], self.samples.seq_length,
                       self.reset_attention_mask)

    def _sample(self, index: int) -> Sample:
        return self.samples.get(index, self.cp_rank, self.cp_size, self.reset_position_ids, self.eod_mask_loss,
                                self.eod_token, cp_ring=self.cp_ring, documents=self.cp_documents)

    def continue_by_sample_count(self, consumed: int) -> None:
        """--override-data-settings where the stream cannot continue by token: from the whole steps of `consumed`."""
        self.consumed_samples = consumed - consumed % self.samples_per_step

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume exactly: the samples consumed, at which length and batch, and where
        each document stream stood when this run's samples began and stands now (None for mock data)."""
        return {"consumed_samples": self.consumed_samples, "seq_length": self.samples.seq_length,
                "samples_per_step": self.samples_per_step,
                "stream_start": _listed(self.samples.stream_position(0)),
                "stream_position": _listed(self.samples.stream_position(self.consumed_samples))}

    def load_state_dict(self, state: dict) -> str:
        """Resume where `state` stopped; returns '' when the run continues sample by sample, else one line saying
        where the token stream continues.

        At the length the state was saved with, sample after sample (the stream offset it started at restored)
        whenever the samples consumed are whole steps of this batch layout. At another `--seq-length`, or a
        batch layout the samples consumed do not divide, the token stream continues at the first token not yet
        trained (each stream of a blend at its own), from sample 0; a source with no token stream (mock data)
        is refused."""
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"consumed_samples {consumed} must be >= 0")
        saved_length = int(state.get("seq_length", self.samples.seq_length))
        saved_step = int(state.get("samples_per_step", self.samples_per_step))
        start = state.get("stream_start")
        if saved_length == self.samples.seq_length and consumed % self.samples_per_step == 0:
            if start is not None and self.samples.stream_position(0) != tuple(start):
                self.samples = self.samples.continued(tuple(start))
            self.consumed_samples = consumed
            return ""
        position = state.get("stream_position")
        if position is None:
            why = "mock data is no token stream" if "stream_start" in state else "the checkpoint records no token position"
            raise ValueError(
                f"the checkpoint's data was read at --seq-length {saved_length} x {saved_step} samples per step "
                f"({consumed} samples consumed), this run reads {self.samples.seq_length} x {self.samples_per_step}, "
                f"and {why} to continue from")
        self.samples = self.samples.continued(tuple(position))
        self.consumed_samples = 0
        return (f"--seq-length {self.samples.seq_length} x {self.samples_per_step} samples per step (the checkpoint "
                f"read {saved_length} x {saved_step}): {self.samples.continues_at(tuple(position))}")


def _listed(position: tuple[int, ...] | None) -> list[int] | None:
    return None if position is None else [int(p) for p in position]


class _MicroBatches(torch.utils.data.Dataset):
    """Micro-batch `k` of a loader's rank by index `(k, position)`: its samples from `k * micro_batch_size * dp_size`
    of its source continued at `position` (the source's `stream_position(0)` when the index was drawn: a worker
    holds the source it was forked with and follows the loader to where a resume moved it)."""

    def __init__(self, loader: MicroBatchLoader) -> None:
        self.loader = loader

    def __getitem__(self, index: tuple[int, tuple[int, ...] | None]) -> Batch:
        k, position = index
        if position is not None and self.loader.samples.stream_position(0) != position:
            self.loader.samples = self.loader.samples.continued(position)
        return self.loader.micro_batch(k)


class _FromPosition(torch.utils.data.Sampler):
    """The micro-batch indices of a loader from where it stands each time it is iterated."""

    def __init__(self, loader: MicroBatchLoader) -> None:
        self.loader = loader

    def __iter__(self):
        import itertools

        lo = self.loader
        position = lo.samples.stream_position(0)
        return ((k, position) for k in itertools.count(lo.consumed_samples // lo.samples_per_step))


def _default_signal_actions(worker_id: int) -> None:
    """A forked worker takes the default action for SIGTERM and SIGUSR1 again: the run that forked it may record
    them to stop at a step boundary (--exit-signal-handler), which a worker has none of."""
    import signal

    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_DFL)


def _identity(batch):
    return batch


class WorkerLoader:
    """A MicroBatchLoader whose micro-batches are read by `num_workers` worker processes of a torch
    DataLoader ahead of the step (Megatron-LM's --num-workers). The same batches in the same order; the
    state counts the batches handed out, not those read ahead, so a checkpoint resumes exactly.

    The workers are forked once, by `start()` (or the first batch), and kept for the loader's life: a resume or
    a new position (`load_state_dict`, `continue_by_sample_count`) restarts them where it says, forking nothing.
    Call `start()` before the process page-locks host memory (offload arenas, FSDP's CPU offload): a fork after
    it copies or shares page-locked pages (terabytes, with offload) in every worker."""

    def __init__(self, loader: MicroBatchLoader, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.loader, self.num_workers = loader, num_workers
        self._workers: torch.utils.data.DataLoader | None = None
        self._iterator = None

    @property
    def samples(self) -> SampleSource:
        return self.loader.samples

    @property
    def samples_per_step(self) -> int:
        return self.loader.samples_per_step

    @property
    def consumed_samples(self) -> int:
        return self.loader.consumed_samples

    def start(self) -> WorkerLoader:
        """Fork the worker processes now; they read ahead from the loader's position."""
        if self._workers is None:
            import multiprocessing

            context = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
            self._workers = torch.utils.data.DataLoader(
                _MicroBatches(self.loader), batch_size=None, sampler=_FromPosition(self.loader),
                num_workers=self.num_workers, collate_fn=_identity, multiprocessing_context=context,
                persistent_workers=True, worker_init_fn=_default_signal_actions)
            self._iterator = iter(self._workers)  # forks them
        return self

    def __iter__(self) -> WorkerLoader:
        return self

    def __next__(self) -> Batch:
        lo = self.loader
        if lo.num_samples is not None and lo.consumed_samples + lo.samples_per_step > lo.num_samples:
            raise StopIteration
        if self._workers is None:
            self.start()
        elif self._iterator is None:
            self._iterator = iter(self._workers)  # the same workers, from the new position
        batch = next(self._iterator)
        lo.consumed_samples += lo.samples_per_step
        return batch

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> str:
        self._iterator = None  # read again from the new position
        return self.loader.load_state_dict(state)

    def continue_by_sample_count(self, consumed: int) -> None:
        self._iterator = None
        self.loader.continue_by_sample_count(consumed)

    def close(self) -> None:
        """Stop the worker processes."""
        self._workers = self._iterator = None
