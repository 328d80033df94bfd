"""Metrics of a run: a console progress line, metrics.jsonl, and tensorboard when asked.

A step with an evaluation is always logged, whatever --log-interval: its record carries
`val_loss` and `val_ppl`, the console gets a validation line of its own, and tensorboard
gets Megatron-LM's `lm loss validation` (and, when asked, `lm loss validation ppl`).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

from megatron_lc.devices import Devices, peak_dense_bf16_flops


LIBRARY_LOGGER = "megatron_lc"


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is when a line is written (a harness may replace it between runs)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def show_library_log(this_rank: bool) -> None:
    """Print the package's INFO lines (page-locking progress, ...) on stdout from `this_rank` (each node's first),
    warnings only elsewhere; set once per process."""
    logger = logging.getLogger(LIBRARY_LOGGER)
    if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if this_rank else logging.WARNING)


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(directory: str | Path, wandb_module) -> str:
    """The wandb run id kept in `directory` (--save), made and kept there by the first run."""
    path = Path(directory) / WANDB_ID_FILE
    if path.exists():
        return path.read_text().strip()
    run_id = wandb_module.util.generate_id()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def default_log_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


class MetricsLogger:
    """Writes one JSON object per logged step; only the logging rank creates files."""

    def __init__(self, log_dir: str | Path, tensorboard_dir: str | None, total_steps: int, enabled: bool = True,
                 wandb: tuple[str | None, str | None, dict] = (None, None, {}),
                 validation_ppl_to_tensorboard: bool = False, wandb_id_dir: str | None = None):
        """`wandb`: (project, run name, config); logs there too when a project is given, continuing the wandb run
        whose id `wandb_id_dir` (--save) holds, so a requeued job's steps go on in the same run."""
        self.enabled = enabled
        self.validation_ppl_to_tensorboard = validation_ppl_to_tensorboard
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

            resumed = {} if wandb_id_dir is None else {"id": wandb_run_id(wandb_id_dir, wandb_module), "resume": "allow"}
            self._wandb = wandb_module.init(project=project, name=name, config=config, dir=str(self.log_dir), **resumed)

    def log(self, metrics: dict, console: bool = True, tensorboard: bool = True) -> None:
        """`console`: the progress line and metrics.jsonl (--log-interval); `tensorboard`: the training
        scalars to tensorboard and wandb (--tensorboard-log-interval). Validation scalars go to tensorboard
        whenever there are some, as Megatron-LM writes them at each evaluation."""
        if not self.enabled:
            return
        if "val_loss" in metrics:
            metrics = {**metrics, "val_ppl": validation_ppl(metrics["val_loss"])}
        if self._tb is not None and (tensorboard or "val_loss" in metrics):
            self._tensorboard(metrics, train_scalars=tensorboard)
        if self._wandb is not None and tensorboard:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
        if not console:
            return
        self._jsonl.write(json.dumps(metrics) + "\n")
        print(self._progress_line(metrics), flush=True)
        if "val_loss" in metrics:
            print(f"validation at step {metrics['step']} | lm loss {metrics['val_loss']:.6E} | "
                  f"lm loss PPL {metrics['val_ppl']:.6E}", flush=True)

    def _tensorboard(self, metrics: dict, train_scalars: bool = True) -> None:
        step = metrics["step"]
        for key, value in metrics.items() if train_scalars else ():
            if key == "params_norm":  # Megatron-LM's name
                self._tb.add_scalar("params-norm", value, step)
            elif key not in ("step", "val_loss", "val_ppl") and isinstance(value, (int, float)):
                self._tb.add_scalar(f"train/{key}", value, step)
        if "val_loss" in metrics:  # Megatron-LM's names, so its dashboards read these runs
            self._tb.add_scalar("lm loss validation", metrics["val_loss"], step)
            if self.validation_ppl_to_tensorboard:
                self._tb.add_scalar("lm loss validation ppl", metrics["val_ppl"], step)

    def _progress_line(self, m: dict) -> str:
        parts = [f"step {m['step']:>5}/{self.total_steps}", f"loss {m['loss']:.4f}"]
        if "loss_tokens" in m:  # the tokens the loss is the mean over (masked targets and padding left out)
            parts.append(f"{m['loss_tokens']:,} loss tokens")
        if "val_loss" in m:
            parts.append(f"val {m['val_loss']:.4f}")
        parts += [f"lr {m['lr']:.2e}", f"grad_norm {m['grad_norm']:.3f}", f"{m['tokens_per_s']:,.0f} tok/s"]
        if "throughput_tflops_per_gpu" in m:  # --log-throughput, Megatron-LM's words
            parts.append(f"throughput per GPU (TFLOP/s/GPU): {m['throughput_tflops_per_gpu']:.1f}")
        if m.get("tflops_per_gpu"):
            parts.append(f"{m['tflops_per_gpu']:.0f} TFLOP/s ({m['mfu']:.0%} MFU)")
        if "params_norm" in m:  # --log-params-norm
            parts.append(f"params norm: {m['params_norm']:.3f}")
        beside = ([f"reserved {m['peak_reserved_gib']:.2f}"] if "peak_reserved_gib" in m else []) + (
            [f"planned {m['planned_peak_gib']:.2f}"] if "planned_peak_gib" in m else [])
        parts.append(f"peak {m['peak_memory_gib']:.2f} GiB" + (f" ({', '.join(beside)})" if beside else ""))
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


def validation_ppl(loss: float) -> float:
    """exp(loss), capped as Megatron-LM caps it (exp(20)) so a diverged run stays plottable."""
    return math.exp(min(20.0, loss))


def format_duration(seconds: float) -> str:
    """7s, 3m05s, 2h01m: what a progress line needs."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


# --- model FLOPs and MFU, as the progress line and tensorboard report them -----------------


def megatron_flops(c, samples: int, seq_length: int) -> float:
    """FLOPs of one step over `samples` samples of `seq_length` tokens, as Megatron-LM's
    num_floating_point_operations counts them for a dense GQA SwiGLU model: 3 (forward, two backward
    GEMMs) x 2 (multiply-add) x, per token, the q/k/v/o projections, the SwiGLU MLP (3 matrices) of every
    layer and the logits (the padded vocabulary), plus the causal attention (half of the S x S scores, QK^T
    and PV) of each whole sample."""
    q, kv, h = c.kv_channels * c.num_attention_heads, c.kv_channels * c.num_query_groups, c.hidden_size
    tokens = samples * seq_length
    per_token = 3 * 2 * (h * c.ffn_hidden_size * 3 * c.num_layers + (h * (q + 2 * kv) + q * h) * c.num_layers
                         + h * c.vocab_size)
    attention = samples * seq_length * seq_length * (3 * 2 * q / 2 * 2) * c.num_layers
    return tokens * per_token + attention


def step_flops(model_config, tokens: int, seq_length: int) -> float:
    """Model FLOPs of one step over `tokens` tokens (whole samples of `seq_length`), as Megatron-LM counts them."""
    return megatron_flops(model_config, tokens // seq_length, seq_length)


def model_flops_utilization(devices: Devices, flops_per_s_per_gpu: float) -> float | None:
    """MFU against the accelerator's dense bf16 peak (`devices.PEAK_DENSE_BF16_FLOPS`); None off CUDA or for an
    accelerator not in the table."""
    if not devices.is_cuda:
        return None
    peak = peak_dense_bf16_flops(torch.cuda.get_device_name(devices.accelerator))
    return flops_per_s_per_gpu / peak if peak else None
