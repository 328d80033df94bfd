"""Megatron's data flags through the trainer: weighted blends, --split with validation, the cache, bad input."""

import numpy as np
import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.data.indexed_dataset import IndexedDatasetBuilder
from megatron_lc.training.trainer import train


def _dataset(prefix, seed: int, high: int = 512, docs: int = 40) -> str:
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        for length in rng.integers(10, 60, size=docs):
            builder.add_item(rng.integers(1, high, size=length))
            builder.end_document()
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _flags(tmp_path, *data):
    return ["--data-path", *data, "--seq-length", "32", "--train-iters", "3", "--device", "cpu",
            "--log-dir", str(tmp_path / "log")]


def test_weighted_blend_with_split_trains_validates_and_reuses_its_cache(tmp_path):
    a, b = _dataset(tmp_path / "a", 0), _dataset(tmp_path / "b", 1)
    flags = _flags(tmp_path, "0.7", a, "0.3", b) + ["--split", "90,10,0", "--eval-interval", "3", "--eval-iters", "1",
                                                     "--data-cache-path", str(tmp_path / "cache")]
    first = train(parse_config(flags))
    assert any((tmp_path / "cache").iterdir())
    again = train(parse_config(flags))  # from the cache: the same samples, so the same losses
    assert [m["loss"] for m in again] == [m["loss"] for m in first] and "val_loss" in first[-1]
    other = train(parse_config(_flags(tmp_path, "0.3", a, "0.7", b) + ["--split", "90,10,0",
                                                                       "--data-cache-path", str(tmp_path / "cache")]))
    assert [m["loss"] for m in other] != [m["loss"] for m in first]  # other weights: the cache is not reused


@pytest.mark.parametrize("data, message", [
    (["0.7"], "0.7"),
    (["x", "{a}"], "x"),
])
def test_weights_that_do_not_pair_are_refused_before_any_work(tmp_path, data, message):
    a = _dataset(tmp_path / "a", 0)
    with pytest.raises(ConfigError, match=message):
        parse_config(_flags(tmp_path, *[d.format(a=a) for d in data])).validate(1)


def test_token_ids_beyond_the_vocabulary_are_named_before_step_one(tmp_path):
    big = _dataset(tmp_path / "big", 0, high=1000)
    with pytest.raises(ConfigError, match=rf"{big}.*vocabulary.*512"):
        train(parse_config(_flags(tmp_path, big)))


def test_eval_interval_with_an_empty_validation_part_is_refused_before_step_one(tmp_path):
    a = _dataset(tmp_path / "a", 0)
    with pytest.raises(ConfigError, match="--eval-interval 1: the validation part is empty"):
        train(parse_config(_flags(tmp_path, a) + ["--split", "100,0,0", "--eval-interval", "1"]))


def test_data_path_without_split_is_split_969_30_1_with_megatrons_warning(tmp_path, capsys):
    a = _dataset(tmp_path / "a", 0, docs=600)
    train(parse_config(_flags(tmp_path, a)))
    out = capsys.readouterr().out
    assert out.count('WARNING: Please specify --split when using --data-path. Using legacy default value of '
                     '"969, 30, 1"') == 1


def test_a_part_rounding_to_no_document_is_one_line(tmp_path, capsys):
    a = _dataset(tmp_path / "a", 0, docs=75)
    train(parse_config(_flags(tmp_path, a)))
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "is empty" in x]
    assert line == (f"--split 969, 30, 1: the test part of {a} is empty (75 documents, range [75, 75)); "
                    "the test part is built without it")


def test_zero_weight_is_refused_naming_the_prefix(tmp_path):
    a, b = _dataset(tmp_path / "a", 0), _dataset(tmp_path / "b", 1)
    with pytest.raises(ConfigError, match=f"--data-path: weight '0' of '{b}' is zero"):
        parse_config(_flags(tmp_path, "0.7", a, "0", b)).validate(1)


def test_validation_window_moves_on_and_wraps():
    from megatron_lc.training.trainer import validation_window

    assert [validation_window(k, 4, 10) for k in range(5)] == [0, 4, 0, 4, 0]
    assert [validation_window(k, 4, 3) for k in range(3)] == [0, 0, 0]  # fewer samples than one window


def test_evaluations_read_eval_iters_global_batches_moving_on_then_test_once(tmp_path, monkeypatch):
    """--eval-iters 2 with --global-batch-size 4 (micro 2): 8 samples per evaluation, the next 8 each
    time; the test part once at the end, as Megatron."""
    from megatron_lc.training import trainer

    loaders, reads = [], []

    class Recording(trainer.MicroBatchLoader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            loaders.append(self)

        def micro_batch(self, step):
            reads.append((loaders.index(self), step))
            return super().micro_batch(step)

    monkeypatch.setattr(trainer, "MicroBatchLoader", Recording)
    a = _dataset(tmp_path / "a", 0, docs=600)
    history = train(parse_config(_flags(tmp_path, a) + ["--split", "80,10,10", "--eval-interval", "1",
                                                         "--eval-iters", "2", "--micro-batch-size", "2",
                                                         "--global-batch-size", "4"]))
    _, valid, test = loaders  # training, validation, test: one loader each, made with the run
    assert [step for loader, step in reads if loader == 1] == list(range(12))  # 3 x 4 micro-batches of 2 samples
    assert [step for loader, step in reads if loader == 2] == list(range(4)) and test.samples is not valid.samples
    assert "test_loss" in history[-1] and all("test_loss" not in m for m in history[:-1])
    assert len({m["val_loss"] for m in history}) == 3


def test_test_data_path_is_evaluated_at_the_end(tmp_path):
    a, b = _dataset(tmp_path / "a", 0, docs=600), _dataset(tmp_path / "b", 1)
    history = train(parse_config(_flags(tmp_path, a) + ["--split", "100,0,0", "--test-data-path", b]))
    assert "test_loss" in history[-1]
