"""When a run stops before --train-iters, and how it tells its scheduler to start it again.

A run stops to be resumed (exit status 3, `errors.EXIT_RESUME`, and the file
`--save/stopped_to_resume.json`) on a signal (--exit-signal-handler), at --exit-interval, or
when its next step could not finish and be saved before its deadline. The deadline is the
earlier of --exit-duration-in-mins (from the start of the run) and the scheduler's own time
limit (Slurm's SLURM_JOB_END_TIME, `scheduler.py`).

Whether a step fits is judged from measured times: the slowest of the last steps of this run
and the slowest save, each x SAFETY, plus LEAVING_S, or before the first of them, the times the resumed
checkpoint recorded (its `timing`), or the planner's predicted step (--memory-plan). A run
with a deadline and no save time known yet saves after its first step to learn it. A fresh
run's first step with no plan has nothing to be judged by: it is started (the checkpoint
loaded, if any, stays the one to resume).

The only point at which every rank holds a consistent state to save is a step boundary; a
signal is acted on there when what is left of the step and its save fit the scheduler's grace
time (--exit-signal-grace-secs, judged from the measured step and save times x SAFETY). When
they do not (steps of hours), the step is abandoned: parameters and optimizer state are untouched
until its optimizer step, so while it is still in its blocks they hold the last finished step.
If that step was never saved and its save fits the grace time (or no save was timed yet: a save
is atomic, one cut short leaves the last checkpoint whole), every rank leaves the step at the
next block boundary (`StepAbandoned`, raised from a block's forward pre-hook, the same boundary on
every rank: each boundary starts a small asynchronous all-reduce of the ranks' flags on a gloo group and
the next one waits for it, so the ranks agree one boundary late without waiting at every block), the last
finished step is saved, exit 3. The blocks are watched only when the run saves (--save): without it
there is no finished step to save, and a signal too late to finish stops the run at once.

Python runs signal handlers on the main thread only, and on a GPU the backward (with the recomputed
blocks whose boundaries these are) runs on autograd's device thread while the main thread waits in C++
until it returns. So the signal is also read at each boundary, from whichever thread passes it: the
handler is backed by `signal.set_wakeup_fd`, whose C-level handler writes the signal's number into a
pipe the moment it arrives; the boundary reads the pipe and judges the signal there, and the Python
handler, when it runs later, finds it judged. Otherwise the run stops at once inside the step, exit 3, and
resumes from its last checkpoint: the work since that save is lost, which --save-interval-minutes
bounds, instead of the whole job being killed mid-save. Each rank judges this alone from its own
times; a rank that judged otherwise is stopped by the launcher when the others have left.

A signal may reach only some ranks, and clocks differ: every rank contributes its flags to one
all-reduce per step, so all of them save and stop at the same step.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_lc.scheduler import Job

SAFETY = 1.2
"""Margin on measured step and save times when judging whether the next step fits before the deadline."""
LEAVING_S = 5.0
"""Seconds a stop takes after its save, added to the judged time: the resume status written, the ranks met, the
processes gone. Also what absorbs the jitter of steps of a second (tests on a loaded machine)."""
RECENT_STEPS = 5
"""Steps whose slowest time predicts the next one (the first step of a run, warm-up, is left out once
others exist)."""
DEFAULT_GRACE_S = 30.0
"""Seconds between a scheduler's signal and its SIGKILL unless --exit-signal-grace-secs says otherwise: torchrun's
shutdown timeout and Slurm's default KillWait."""
STOPPED_FILE = "stopped_to_resume.json"
"""Written into --save when the run stopped to be resumed; removed when a run takes the --save lock. A
launcher that hides the exit status (torchrun exits 1 when any worker exits non-zero) is read by it."""


@dataclass
class StepTiming:
    """Measured step and save times of this run, and those the resumed checkpoint recorded."""

    step_times: list[float] = field(default_factory=list)
    save_times: list[float] = field(default_factory=list)
    recorded_step_s: float | None = None
    recorded_save_s: float | None = None
    planned_step_s: float | None = None
    """The planner's prediction (--memory-plan), used until a step is measured or recorded."""

    @classmethod
    def resumed(cls, recorded: dict | None) -> StepTiming:
        recorded = recorded or {}
        return cls(recorded_step_s=recorded.get("step_s"), recorded_save_s=recorded.get("save_s"))

    def step_s(self) -> float | None:
        """The next step's predicted time, before the margin (None: nothing measured or recorded)."""
        times = self.step_times[1:] or self.step_times
        if times:
            return max(times[-RECENT_STEPS:])
        return self.recorded_step_s if self.recorded_step_s is not None else self.planned_step_s

    def save_s(self) -> float | None:
        return max(self.save_times) if self.save_times else self.recorded_save_s

    def to_dict(self) -> dict:
        """What a checkpoint records for the run that resumes it."""
        return {"step_s": self.step_s(), "save_s": self.save_s()}


@dataclass(frozen=True)
class Deadline:
    at: float
    """Unix time."""
    name: str


def deadlines(exit_duration_in_mins: float | None, started: float, job: Job) -> list[Deadline]:
    found = []
    if exit_duration_in_mins:
        found.append(Deadline(started + 60 * exit_duration_in_mins,
                              f"--exit-duration-in-mins {exit_duration_in_mins:g}"))
    if job.end_time is not None:
        found.append(Deadline(job.end_time, f"the time limit of {job.describe()} (SLURM_JOB_END_TIME)"))
    return sorted(found, key=lambda d: d.at)


@dataclass(frozen=True)
class Decision:
    """What every rank does at a step boundary."""

    stop: str | None = None
    """Why the run stops here (None: go on)."""
    save: bool = False
    """Save at this boundary for time's sake (the deadline, --save-interval-minutes, or to measure a save)."""
    for_time: bool = False
    """The stop is the deadline's (no signal): the next step would not finish and save before it."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What a scheduler sends before it kills a job (Slurm's --signal, torchrun forwarding its own SIGTERM)."""


class StartupSignals:
    """Stop signals received while the run starts (the model built, a checkpoint loaded, a terabyte page-locked:
    minutes at these sizes), before its StopRequest exists: recorded, so that the run stops before its first step
    (exit 3, nothing lost) instead of dying mid-start-up. With `handle` False (no --exit-signal-handler) nothing
    is installed."""

    def __init__(self, handle: bool):
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS} if handle else {}

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class StepAbandoned(Exception):
    """Raised at a block boundary of a step a stop signal abandons (every rank at the same one), to save the last
    finished step instead."""


class StopRequest:
    """The stop and save-by-time decisions of one run, taken together by every rank at each step boundary."""

    SIGNALS = STOP_SIGNALS

    def __init__(self, handle_signals: bool, deadlines: list[Deadline], save_interval_minutes: float | None,
                 timing: StepTiming, device: torch.device, clock=time.time, grace_s: float | None = None,
                 abandon: Callable[[str], None] | None = None, received: int | None = None):
        self.handle_signals = handle_signals
        self.deadline = deadlines[0] if deadlines else None
        self.save_interval_s = 60 * save_interval_minutes if save_interval_minutes else None
        self.timing, self.device, self.clock = timing, device, clock
        self.grace_s, self.abandon = grace_s, abandon
        self.last_save = clock()
        self.received: int | None = received
        """A stop signal's number once one arrived (`received`: one of start-up's, `StartupSignals`)."""
        self.in_step: tuple[int, float] | None = None
        """(step, its start) while a step runs."""
        self.unsaved_step: int | None = None
        """The last finished step while no checkpoint holds it (set by the trainer)."""
        self.abandoning: str | None = None
        """Why the step in progress is left at its next block boundary (set by the signal handler)."""
        self.boundary_group = None
        """The group the ranks agree through at each block boundary (a gloo group; None: one process)."""
        self._agreeing: tuple | None = None
        """The previous boundary's asynchronous all-reduce (its work, its flag) not yet waited for."""
        self._judging = threading.RLock()  # the boundary (any thread) and the Python handler (main thread)
        self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS} if handle_signals else {}
        self._wakeup: int | None = None
        """The read end of the pipe the C-level signal handler writes each signal's number into."""
        self._previous_wakeup: int | None = None
        if handle_signals:
            self._wakeup, written = os.pipe()
            for fd in (self._wakeup, written):
                os.set_blocking(fd, False)
            try:
                self._previous_wakeup = signal.set_wakeup_fd(written, warn_on_full_buffer=False)
            except ValueError:  # not the main thread: the Python handler alone, at the main thread's next bytecode
                os.close(written)
                os.close(self._wakeup)
                self._wakeup = None
            else:
                self._written = written

    def begin_step(self, step: int) -> None:
        self.in_step = (step, self.clock())

    def end_step(self, finished: bool = True) -> None:
        """The step is over. `finished`: it returned (on every rank): the last boundary's agreement is waited for,
        so that every rank has started and ended the same collectives; otherwise (an error) it is dropped, so that
        this rank fails at once instead of waiting for ranks that may never reach it."""
        if self._agreeing is not None and finished:
            self._agreeing[0].wait()
        self._agreeing = None
        self.in_step = None

    def _on_signal(self, signum, frame) -> None:
        """The Python handler (main thread). With the wakeup pipe the signal's byte is in it, or a block boundary
        already read and judged it: judged once either way."""
        self.received = signum
        if self._wakeup is None:
            self._judge(signum)
        else:
            self._read_wakeup()

    def _read_wakeup(self) -> None:
        """Judge each stop signal whose number the C-level handler wrote since the last read (any thread)."""
        if self._wakeup is None:
            return
        with self._judging:
            while True:
                try:
                    arrived = os.read(self._wakeup, 64)
                except (BlockingIOError, OSError):
                    return
                if not arrived:
                    return
                for signum in arrived:
                    if signum in self.SIGNALS:
                        self.received = signum
                        self._judge(signum)

    def _judge(self, signum: int) -> None:
        """Act on stop signal `signum` inside a step: go on, leave at the next block boundary, or leave now."""
        reason = self.too_late_to_finish(signum)
        if reason is None or self.abandon is None:
            return
        if self.unsaved_step is not None and self._save_fits_grace():
            self.abandoning = reason  # left at the next block boundary, the last finished step saved
        else:
            self.abandon(reason)

    def _save_fits_grace(self) -> bool:
        """Whether a save of the last finished step ends within the grace time (untimed: tried, it is atomic)."""
        save = self.timing.save_s()
        return save is None or save * SAFETY + LEAVING_S <= self.grace_s

    def at_block_boundary(self) -> None:
        """Raise `StepAbandoned` on every rank at the same block boundary once any rank abandons the step (any
        thread: autograd's runs the recomputed blocks). With several processes each boundary waits for the
        previous one's all-reduce and starts its own: one outstanding per rank, the same count on every rank."""
        self._read_wakeup()
        if self.in_step is None:
            return
        if self.boundary_group is None:
            if self.abandoning is not None:
                raise StepAbandoned(self.abandoning)
            return
        if self._agreeing is not None:
            work, flag = self._agreeing
            self._agreeing = None
            work.wait()
            if flag.item():
                raise StepAbandoned(self.abandoning or "a stop signal on another rank")
        flag = torch.tensor([int(self.abandoning is not None)], dtype=torch.int32)
        self._agreeing = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.boundary_group, async_op=True),
                          flag)

    def watch_blocks(self, blocks) -> list:
        """Check `at_block_boundary` before each block's forward (its recompute in the backward too), ahead of the
        block's other hooks (FSDP's all-gather); the hooks' handles. With several processes the ranks agree at every
        boundary, which they all pass in one order."""
        return [block.register_forward_pre_hook(lambda module, args: self.at_block_boundary(), prepend=True)
                for block in blocks]

    def too_late_to_finish(self, signum: int) -> str | None:
        """Why the step in progress cannot finish and save within the grace time after signal `signum` (None: it
        can, no step runs, or no grace time is given)."""
        if self.in_step is None or self.grace_s is None:
            return None
        step, started = self.in_step
        name = signal.Signals(signum).name
        measured, save = self.timing.step_s(), self.timing.save_s() or 0.0
        if measured is None:
            return (f"signal {name} during step {step}, whose length nothing has measured yet, with "
                    f"{self.grace_s:g} s before the scheduler's SIGKILL (--exit-signal-grace-secs)")
        left = max(measured - (self.clock() - started), 0.0)
        if (left + save) * SAFETY <= self.grace_s:
            return None
        return (f"signal {name} during step {step}: what is left of it (~{left:.0f} s) and its save ({save:.0f} s), "
                f"x{SAFETY:g}, pass the {self.grace_s:g} s before the scheduler's SIGKILL (--exit-signal-grace-secs)")

    def saved(self) -> None:
        self.last_save = self.clock()

    def _time_left_too_short(self) -> str | None:
        """Why the next step cannot finish and be saved before the deadline (None: it can, or nothing says)."""
        if self.deadline is None:
            return None
        left = self.deadline.at - self.clock()
        step, save = self.timing.step_s(), self.timing.save_s() or 0.0
        if left <= 0:
            return f"{self.deadline.name} reached"
        if step is None or (step + save) * SAFETY + LEAVING_S <= left:
            return None
        return (f"the next step ({step:.0f} s) and its save ({save:.0f} s), x{SAFETY:g}, and {LEAVING_S:g} s to "
                f"leave would pass {self.deadline.name} in {left:.0f} s")

    def decide(self, *, may_save: bool) -> Decision:
        """This boundary's decision, the same on every rank. `may_save`: a checkpoint can be written (--save)."""
        if not self.handle_signals and self.deadline is None and self.save_interval_s is None:
            return Decision()
        late = self._time_left_too_short()
        measure = may_save and self.deadline is not None and self.timing.save_s() is None
        interval = self.save_interval_s is not None and self.clock() - self.last_save >= self.save_interval_s
        flags = torch.tensor([self.received is not None, late is not None, measure or interval],
                             dtype=torch.int32, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, timed_out, save = flags.tolist()
        if signalled:
            name = signal.Signals(self.received).name if self.received else "on another rank"
            return Decision(f"signal {name}", True)
        if timed_out:
            # Every rank has the same deadline; the one whose clock said "too late" first may be another.
            near = f"the next step would pass {self.deadline.name}" if self.deadline is not None else "the deadline"
            return Decision(late or f"{near} (judged on another rank)", True, for_time=True)
        return Decision(None, bool(save))

    def close(self) -> None:
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            os.close(self._wakeup)
            os.close(self._written)
            self._wakeup = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def mark_stopped(save_dir: str | os.PathLike, step: int, reason: str) -> Path:
    """Record in --save that the run stopped at `step` to be resumed (read by recipes under torchrun)."""
    path = Path(save_dir) / STOPPED_FILE
    path.write_text(json.dumps({"step": step, "reason": reason, "time": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return path


def clear_stopped(save_dir: str | os.PathLike) -> None:
    (Path(save_dir) / STOPPED_FILE).unlink(missing_ok=True)
