"""Metrics of a run: a console progress line, metrics.jsonl, and tensorboard when asked."""

from __future__ import annotations

import json
import time
from pathlib import Path


def default_log_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


class MetricsLogger:
    """Writes one JSON object per logged step; only the logging rank creates files."""

    def __init__(self, log_dir: str | Path, tensorboard_dir: str | None, total_steps: int, enabled: bool = True):
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_dir = Path(log_dir)
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.log_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard_dir)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(metrics) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, metrics["step"])
        print(self._progress_line(metrics), flush=True)

    def _progress_line(self, m: dict) -> str:
        parts = [f"step {m['step']:>5}/{self.total_steps}", f"loss {m['loss']:.4f}"]
        if "val_loss" in m:
            parts.append(f"val {m['val_loss']:.4f}")
        parts += [f"lr {m['lr']:.2e}", f"grad_norm {m['grad_norm']:.3f}", f"{m['tokens_per_s']:,.0f} tok/s"]
        if m.get("tflops_per_gpu"):
            parts.append(f"{m['tflops_per_gpu']:.0f} TFLOP/s ({m['mfu']:.0%} MFU)")
        parts.append(f"peak {m['peak_memory_gib']:.2f} GiB")
        if m.get("host_offload_gib"):
            parts.append(f"host {m['host_offload_gib']:.2f} GiB")
        return " | ".join(parts)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
