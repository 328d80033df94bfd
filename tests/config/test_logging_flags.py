"""--log-throughput, --log-params-norm and --tensorboard-log-interval, through the trainer."""

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_lc.arguments import parse_config
from megatron_lc.training.logging import megatron_flops
from megatron_lc.training.trainer import build_run, train
from tests.helpers import train_flags

BASE = train_flags("--num-layers", "2", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
                   "--num-query-groups", "2", "--kv-channels", "8", "--vocab-size", "100", tiny_model=True)


def megatron_12x(B, S, L, h, heads, groups, d, ffn, V) -> float:
    """Megatron-LM's num_floating_point_operations as it was first written (the 12x form, GQA, SwiGLU)."""
    q = d * heads
    return 12 * B * S * L * h * h * ((1 + groups / heads + S / h / 2) * q / h + ffn / h * 3 / 2 + V / (2 * L * h))


def test_throughput_per_gpu_is_on_the_console_line_as_megatron_computes_it(tmp_path, capsys):
    history = train(parse_config(BASE + ["--train-iters", "4", "--log-interval", "2", "--log-throughput",
                                         "--global-batch-size", "2", "--log-dir", str(tmp_path)]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert len(lines) == 3 and all("throughput per GPU (TFLOP/s/GPU): " in line for line in lines)
    flops = megatron_12x(2, 16, 2, 32, 4, 2, 8, 48, 100)
    run = build_run(parse_config(BASE + ["--global-batch-size", "2"]))
    assert megatron_flops(run.model.config, 2, 16) == pytest.approx(flops, rel=1e-12)
    logged = {m["step"]: m for m in history if "throughput_tflops_per_gpu" in m}
    assert sorted(logged) == [1, 2, 4]
    per_step = (history[2]["step_time_s"] + history[3]["step_time_s"]) / 2  # the steps since the last line
    assert logged[4]["throughput_tflops_per_gpu"] == pytest.approx(flops / per_step / 1e12, rel=1e-9)


def test_params_norm_is_the_l2_norm_of_every_weight_after_the_step(tmp_path, capsys):
    history = train(parse_config(BASE + ["--train-iters", "2", "--log-params-norm", "--save", str(tmp_path / "c"),
                                         "--log-dir", str(tmp_path / "log")]))
    assert "params norm: " in capsys.readouterr().out
    from megatron_lc.training import checkpointing

    run = build_run(parse_config(BASE))
    checkpointing.load_model_weights(checkpointing.latest_checkpoint(tmp_path / "c"), run.model)
    expected = math.sqrt(sum(float((p.detach().double() ** 2).sum()) for p in run.model.parameters()))
    assert history[-1]["params_norm"] == pytest.approx(expected, rel=1e-5)
    assert "params_norm" not in train(parse_config(BASE + ["--train-iters", "1", "--log-dir", str(tmp_path / "n")]))[0]


def test_tensorboard_gets_every_nth_step_whatever_the_console_interval(tmp_path):
    train(parse_config(BASE + ["--train-iters", "5", "--log-interval", "5", "--tensorboard-log-interval", "2",
                               "--log-params-norm", "--tensorboard-dir", str(tmp_path / "tb"),
                               "--log-dir", str(tmp_path / "log")]))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
    assert [e.step for e in events.Scalars("params-norm")] == [2, 4]
    assert len((tmp_path / "log" / "metrics.jsonl").read_text().splitlines()) == 2  # console: steps 1 and 5
    assert torch.isfinite(torch.tensor([e.value for e in events.Scalars("params-norm")])).all()


def test_the_attention_kernel_that_runs_is_printed_and_recorded_in_metrics(tmp_path, capsys):
    import json

    train(parse_config(BASE + ["--train-iters", "1", "--log-dir", str(tmp_path / "log")]))
    assert "attention: cpu_flash" in capsys.readouterr().out
    record = json.loads((tmp_path / "log" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["attention_kernel"] == "cpu_flash"


def _fake_wandb(monkeypatch) -> list[dict]:
    """A stand-in for the wandb package that records each init's arguments."""
    import importlib.machinery
    import sys
    import types

    inits, ids = [], iter(["abc123", "def456"])
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.util = types.SimpleNamespace(generate_id=lambda: next(ids))

    def init(**kwargs):
        inits.append(kwargs)
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda *a, **k: None)
    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return inits


def test_wandb_continues_the_same_run_across_requeues(tmp_path, monkeypatch):
    """The wandb run id is kept in --save: a requeued (resumed) job logs into the run it started."""
    inits = _fake_wandb(monkeypatch)
    flags = BASE + ["--wandb-project", "p", "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    train(parse_config(flags + ["--train-iters", "4", "--exit-interval", "2", "--log-dir", str(tmp_path / "a")]))
    train(parse_config(flags + ["--train-iters", "4", "--log-dir", str(tmp_path / "b")]))
    assert [(i["project"], i["id"], i["resume"]) for i in inits] == [("p", "abc123", "allow"), ("p", "abc123", "allow")]
    assert (tmp_path / "ckpt" / "wandb_run_id").read_text() == "abc123\n"
    train(parse_config(BASE + ["--wandb-project", "p", "--train-iters", "1", "--log-dir", str(tmp_path / "c")]))
    assert "id" not in inits[-1]  # no --save: a new run each time


def test_peak_memory_is_the_steps_allocated_and_reserved_on_cuda(monkeypatch):
    """On CUDA the peaks are the allocator's since the step began, reserved beside allocated (a recording
    stand-in for torch.cuda here; the CPU has no per-step peak)."""
    import types

    from megatron_lc.devices import Devices
    from megatron_lc.training.logging import MetricsLogger
    from megatron_lc.training.trainer import step_peak_memory

    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: asked.append(("allocated", d)) or 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: asked.append(("reserved", d)) or 4 * 2**30)
    cuda = torch.device("cuda", 0)
    run = types.SimpleNamespace(devices=Devices(cuda, torch.device("cpu")), pstate=types.SimpleNamespace(distributed=False))
    peaks = step_peak_memory(run)
    assert peaks == {"peak_memory_gib": 3.0, "peak_reserved_gib": 4.0}
    assert asked == [("allocated", cuda), ("reserved", cuda)]
    metrics = {"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, **peaks}
    assert "peak 3.00 GiB (reserved 4.00)" in MetricsLogger(".", None, 1, enabled=False)._progress_line(metrics)
