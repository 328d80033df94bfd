"""Estimates made several at a time and remembered: what the planner's searches trace through.

An estimate is two fake-tensor traces of a training step: seconds of one CPU core each, independent of
the sequence length. The searches (`search.find_max_seq_length`, `autofit`) ask for estimates in rounds;
`EstimatePool.many` runs a round on worker processes (one per core, up to `MAX_WORKERS`): an estimate per
worker, or, in a round of fewer estimates than workers once the workers have started, each estimate's
traces at once on them (a round of one estimate then takes the wall time of one trace), and every
estimate is kept in a cache on disk keyed by the configuration, the machine and a fingerprint of this
package's code and torch's version, so asking again (another search, another call) costs nothing and a
change of code never answers from an old trace. Every answer a search prints is still an estimate of
that configuration: the cache only skips tracing the same thing twice.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures.process import BrokenProcessPool
import hashlib
import multiprocessing
import os
import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_lc.config import TrainConfig
from megatron_lc.plan_cache import code_fingerprint, files_named
from megatron_lc.planning.estimate import Estimate, Machine, TraceJob, estimate, planning_config, trace_job
from megatron_lc.planning.trace import StepTrace

MAX_WORKERS = 8
"""Worker processes at most: each holds a traced model of a few layers (about 1 GiB)."""
Job = tuple[TrainConfig, Machine, "int | None"]


def default_workers() -> int:
    """One worker per core this process may use, at most `MAX_WORKERS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))


class EstimateCache:
    """Estimates on disk, one file per (configuration, machine, code); unreadable files count as absent."""

    def __init__(self, directory: Path | None):
        self.directory = directory

    def key(self, cfg: TrainConfig, machine: Machine, seq_length: int | None, exact: bool = False) -> str:
        # A packed run's step time is counted from its data's documents: the data files are part of the answer.
        data = files_named([*cfg.data.data_path, *cfg.data.train_data_path]) if cfg.packing.packing == "documents" \
            else []
        what = repr((planning_config(cfg, seq_length), machine, code_fingerprint(), data) + (("exact",) if exact else ()))
        return hashlib.sha256(what.encode()).hexdigest()

    def get(self, key: str) -> Estimate | None:
        if self.directory is None:
            return None
        try:
            with open(self.directory / f"{key}.pkl", "rb") as f:
                found = pickle.load(f)
        except Exception:  # absent, partial, from another version: traced again
            return None
        return found if isinstance(found, Estimate) else None

    def put(self, key: str, e: Estimate) -> None:
        if self.directory is None:
            return
        partial = self.directory / f"{key}.{os.getpid()}.tmp"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(partial, "wb") as f:
                pickle.dump(e, f)
            os.replace(partial, self.directory / f"{key}.pkl")  # whole or absent, with several planners at once
        except OSError:  # a read-only or full disk costs the cache, not the answer
            partial.unlink(missing_ok=True)


def _at_least(e: Estimate) -> bool:
    return getattr(e, "at_least", False)  # a stand-in's answers may not say


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one core per worker: the workers are the parallelism


class EstimatePool:
    """`estimate` (or a stand-in with its signature), run `workers` at a time and remembered.

    Callable as `estimate(cfg, machine, seq_length)`; `many` takes a round of jobs. Worker processes
    run the real `estimate` only (a stand-in runs in this process, as tests give one). It keeps the count
    and the seconds of the traces it made, for progress lines with an ETA."""

    def __init__(self, evaluate: Callable[[TrainConfig, Machine, int | None], Estimate] = estimate,
                 workers: int = 1, cache: EstimateCache | None = None, exact: bool = False):
        self.evaluate, self.workers = evaluate, max(1, workers)
        self.exact = exact
        """`estimate(..., exact=True)`: every rank of the per-rank loops traced (the real `estimate` only)."""
        self.stop_when_over = False
        """`estimate(..., stop_when_over=True)`: a step whose fewer traced layers are over a budget is answered by
        them (`Estimate.at_least`), for searches that only need to know that it does not fit (auto-fit)."""
        self.cache = cache or EstimateCache(None)
        self.memory: dict[str, Estimate] = {}
        self.traced = self.cached = 0
        self.trace_seconds = 0.0
        """Wall seconds of the rounds that traced, summed: a round of n traces on w workers counts once."""
        self.started = time.perf_counter()
        self.expected_left: int | None = None
        """Traces the running search expects still to make (an upper bound where it knows one), for the ETA."""
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def __call__(self, cfg: TrainConfig, machine: Machine, seq_length: int | None = None) -> Estimate:
        return self.many([(cfg, machine, seq_length)])[0]

    def remembers(self, job: Job) -> bool:
        """Whether `job`'s estimate is known already (this call's or the cache's): asking costs no trace."""
        key = self.cache.key(*job, self.exact)
        known = self.memory.get(key) or self.cache.get(key)
        return known is not None and (self.stop_when_over or not _at_least(known))

    def many(self, jobs: Sequence[Job]) -> list[Estimate]:
        """The estimates of `jobs`, in order: remembered ones at once, the rest traced together."""
        keys = [self.cache.key(*job, self.exact) for job in jobs]
        todo: dict[str, Job] = {}
        for key, job in zip(keys, jobs):
            if key in self.memory and _at_least(self.memory[key]) and not self.stop_when_over:
                del self.memory[key]  # bytes at least: this caller needs them all
            if key not in self.memory and key not in todo:
                found = self.cache.get(key)
                if found is not None and _at_least(found) and not self.stop_when_over:
                    found = None
                if found is not None:
                    self.memory[key] = found
                    self.cached += 1
                else:
                    todo[key] = job
        if todo:
            start = time.perf_counter()
            for key, e in zip(todo, self._trace(list(todo.values()))):
                self.memory[key] = e
                self.cache.put(key, e)
            self.trace_seconds += time.perf_counter() - start
            self.traced += len(todo)
        return [self.memory[key] for key in keys]

    def _trace(self, jobs: list[Job]) -> list[Estimate]:
        if self.evaluate is not estimate:
            return [self.evaluate(*job) for job in jobs]
        flags = (self.exact, self.stop_when_over)
        if self.workers == 1 or (len(jobs) == 1 and self._pool is None):
            return [estimate(*job, *flags) for job in jobs]  # starting workers would cost more than they save
        if len(jobs) < self.workers:  # idle workers: each estimate's traces at once, the estimates side by side
            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as threads:
                return list(threads.map(lambda job: estimate(*job, *flags, run_traces=self._run_traces), jobs))
        try:
            return list(self._workers().map(estimate, *zip(*jobs), *([flag] * len(jobs) for flag in flags)))
        except BrokenProcessPool:
            self._pool = None  # a worker died (out of memory?): this round again, here
            return [estimate(*job, *flags) for job in jobs]

    def _workers(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker)
        return self._pool

    def _run_traces(self, jobs: Sequence[TraceJob]) -> list[StepTrace]:
        """One estimate's traces on the workers, at once (a `TraceRunner`)."""
        try:
            return list(self._workers().map(trace_job, jobs))
        except BrokenProcessPool:
            self._pool = None  # a worker died (out of memory?): these traces again, here
            return [trace_job(job) for job in jobs]

    @property
    def seconds_per_round(self) -> float | None:
        """Mean wall seconds of a round of traces so far (None before the first)."""
        rounds = max(1, self.traced // self.workers) if self.traced else 0
        return self.trace_seconds / rounds if rounds else None

    def eta_s(self, traces_left: int) -> float | None:
        """Seconds for `traces_left` more traces at this run's pace (None before the first trace)."""
        per_round = self.seconds_per_round
        return None if per_round is None else per_round * -(-traces_left // self.workers)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def progress(self) -> str:
        """`[elapsed | traced (cached) | ETA]` for a progress line."""
        parts = [f"{self.elapsed_s():5.0f} s", f"{self.traced} traced" + (f", {self.cached} cached" if self.cached else "")]
        eta = None if self.expected_left is None else self.eta_s(self.expected_left)
        if eta is not None:
            parts.append(f"ETA <= {eta:.0f} s" if self.expected_left else "finishing")
        return "[" + " | ".join(parts) + "]"

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "EstimatePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

