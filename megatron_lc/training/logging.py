"""Metrics of a run: a console progress line, metrics.jsonl, and tensorboard when asked."""

from __future__ import annotations

import json
import time
from pathlib import Path


def default_log_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


class MetricsLogger:
    """Writes one JSON object per logged step; only the logging rank creates files."""

    def __init__(self, log_dir: str | Path, tensorboard_dir: str | None, total_steps: int, enabled: bool = True,
                 wandb: tuple[str | None, str | None, dict] = (None, None, {})):
        """`wandb`: (project, run name, config); logs there too when a project is given."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_dir = Path(log_dir)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.log_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard_dir)
        project, name, config = wandb
        if project:
            import wandb as wandb_module  # optional: checked at configuration time

            self._wandb = wandb_module.init(project=project, name=name, config=config, dir=str(self.log_dir))

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(metrics) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, metrics["step"])
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
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
        if "eta_s" in m:
            parts.append(f"elapsed {format_duration(m['elapsed_s'])} ETA {format_duration(m['eta_s'])}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def format_duration(seconds: float) -> str:
    """7s, 3m05s, 2h01m: what a progress line needs."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
