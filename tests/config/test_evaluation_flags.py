"""--skip-train and --full-validation, through the trainer."""

import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training import checkpointing
from megatron_lc.training.trainer import build_run, train
from tests.helpers import TINY_MODEL_FLAGS, write_random_dataset

MODEL = [*TINY_MODEL_FLAGS, "--vocab-size", "128", "--device", "cpu", "--lr", "3e-3"]


def _dataset(prefix) -> str:
    return write_random_dataset(prefix, documents=30, lengths=(10, 40), vocab=128)


@pytest.fixture
def data(tmp_path):
    return ["--data-path", _dataset(tmp_path / "a"), "--split", "70,20,10"]


def test_skip_train_evaluates_the_loaded_weights_without_a_step(tmp_path, data, capsys):
    ckpt = str(tmp_path / "ckpt")
    trained = train(parse_config(MODEL + data + ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2",
                                                 "--save", ckpt, "--log-dir", str(tmp_path / "log")]))
    capsys.readouterr()
    result = train(parse_config(MODEL + data + ["--skip-train", "--load", ckpt, "--eval-iters", "2",
                                                "--log-dir", str(tmp_path / "eval")]))
    out = capsys.readouterr().out
    assert result[0]["step"] == 2 and result[0]["val_loss"] == pytest.approx(trained[-1]["val_loss"], rel=1e-6)
    assert result[0]["test_loss"] == pytest.approx(trained[-1]["test_loss"], rel=1e-6)
    assert "validation at step 2 | lm loss" in out and "test at step 2 | lm loss" in out
    assert not (tmp_path / "eval").exists()  # nothing trained, nothing logged
    assert [p.name for p in checkpointing.Path(ckpt).glob("iter_*")] == ["iter_0000002"]


def test_full_validation_reads_the_whole_validation_part_once(tmp_path, data):
    samples = len(build_run(parse_config(MODEL + data + ["--full-validation", "--eval-interval", "1"])).valid_source)
    assert samples >= 2
    full = train(parse_config(MODEL + data + ["--train-iters", "1", "--eval-interval", "1", "--full-validation",
                                              "--log-dir", str(tmp_path / "full")]))
    every = train(parse_config(MODEL + data + ["--train-iters", "1", "--eval-interval", "1", "--eval-iters",
                                               str(samples), "--log-dir", str(tmp_path / "iters")]))
    two = train(parse_config(MODEL + data + ["--train-iters", "1", "--eval-interval", "1", "--eval-iters", "1",
                                             "--log-dir", str(tmp_path / "one")]))
    assert full[0]["val_loss"] == pytest.approx(every[0]["val_loss"], rel=1e-6)
    assert full[0]["val_loss"] != pytest.approx(two[0]["val_loss"], rel=1e-6)


@pytest.mark.parametrize("flags, message", [
    (["--mock-data", "--skip-train"], "--skip-train evaluates the validation and test parts"),
    (["--mock-data", "--full-validation"], "--full-validation reads the whole validation part"),
])
def test_evaluation_flags_without_evaluation_data_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(MODEL + flags).validate(world_size=1)
