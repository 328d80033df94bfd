"""Preprocessing's progress: a tqdm bar over the input's bytes on a terminal, log lines with the time left
otherwise."""

from __future__ import annotations

import sys
import time
from typing import Callable

# A progress line at least this often, whatever --log-interval: a corpus of long documents
# can take minutes between multiples of it.
PROGRESS_SECONDS = 30.0


class Progress:
    """A tqdm bar over the input's bytes on a terminal; log lines otherwise, each time the document count
    passes a multiple of `log_interval` and at least every `PROGRESS_SECONDS`. Both show the bytes read of
    the input's total, MB/s and the time left at that rate."""

    def __init__(self, enabled: bool, log_interval: int, position: int = 0, label: str = "",
                 total_bytes: int = 0, bytes_read: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.perf_counter, stream=None) -> None:
        self.documents = 0
        self.tokens = 0
        self._clock = clock
        self.start = clock()
        self._last_line = self.start
        self._log_interval = max(1, log_interval)
        self._label = label
        self._total_bytes = total_bytes
        self._bytes_read = bytes_read or (lambda: 0)
        self._stream = stream or sys.stderr
        self._bar = None
        self._log = enabled and not self._stream.isatty()
        if enabled and self._stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(desc=label or "input", total=total_bytes or None, unit="B", unit_scale=True,
                             position=position, dynamic_ncols=True, file=self._stream)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        if self._bar is not None:
            self._bar.close()

    def add(self, documents: int, tokens: int) -> None:
        before = self.documents
        self.documents += documents
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(max(0, self._bytes_read() - self._bar.n))
            self._bar.set_postfix_str(f"{self.documents:,} docs, {self.tokens_per_second:,.0f} tokens/s",
                                      refresh=False)
            return
        now = self._clock()
        passed = self.documents // self._log_interval > before // self._log_interval
        if self._log and documents and (passed or now - self._last_line >= PROGRESS_SECONDS):
            self._last_line = now
            print(self.line(), file=self._stream, flush=True)

    def line(self) -> str:
        """Documents, tokens, bytes read of the total, the rates, and the time left."""
        done, total, seconds = self._bytes_read(), self._total_bytes, self.elapsed
        rate = done / seconds
        share = f" ({100 * done / total:.1f}%)" if total else ""
        left = format_duration((total - done) / rate) if total and rate > 0 else "?"
        return (f"{self._label}{self.documents:,} documents, {self.tokens:,} tokens, {format_size(done)} of "
                f"{format_size(total)} read{share}, {format_size(rate)}/s, {self.documents / seconds:,.1f} docs/s, "
                f"{self.tokens_per_second:,.0f} tokens/s, ETA {left}")

    @property
    def elapsed(self) -> float:
        return max(self._clock() - self.start, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.elapsed


def format_size(size: float) -> str:
    """Bytes in decimal units, as `du --si` and tqdm write them: 512 B, 1.5 kB, 36.2 MB, 1.2 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size:.0f} B"


def format_duration(seconds: float) -> str:
    """H:MM:SS."""
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
