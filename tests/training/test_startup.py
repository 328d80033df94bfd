"""Training and evaluation start through one path (`training.startup.start_processes`): the same steps, in the
same order, with the same settings."""

import pytest

from megatron_lc import evaluate
from megatron_lc.arguments import parse_config
from megatron_lc.training import startup, trainer
from tests.helpers import train_flags, write_random_dataset


class _Stop(Exception):
    pass


def _record_start(monkeypatch) -> list:
    """The start-up's steps as they run; stops the entry point at the warm-up (nothing is built after)."""
    steps = []
    real_devices = startup.resolve_devices
    monkeypatch.setattr(startup, "set_cuda_allocator_settings", lambda: steps.append("allocator"))
    monkeypatch.setattr(startup, "resolve_devices",
                        lambda name, rank: (steps.append(("devices", name)), real_devices(name, rank))[1])
    monkeypatch.setattr(startup, "init_distributed", lambda device, **kw: steps.append(("process group", kw)))

    def warm_up(pstate, device):
        steps.append(("warm-up", pstate.dims))
        raise _Stop

    monkeypatch.setattr(startup, "warm_up_collectives", warm_up)
    return steps


def test_evaluation_starts_as_training_does(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    trainer.train(parse_config(train_flags("--train-iters", "1", "--save", str(ckpt), "--log-dir", str(tmp_path / "l"),
                                           tiny_model=True)))
    data = write_random_dataset(tmp_path / "d", documents=20, lengths=(10, 40), vocab=64)
    steps = _record_start(monkeypatch)
    with pytest.raises(_Stop):
        trainer.build_run(parse_config(train_flags(tiny_model=True)))
    trained, steps[:] = list(steps), []
    with pytest.raises(_Stop):
        evaluate.evaluate(evaluate.build_parser().parse_args(["--load", str(ckpt), "--data-path", data,
                                                              "--seq-length", "16", "--device", "cpu"]))
    assert steps == trained and [s if isinstance(s, str) else s[0] for s in steps] == [
        "allocator", "devices", "process group", "warm-up"]
