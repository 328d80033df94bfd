"""Megatron's data flags through the trainer: weighted blends, --split with validation, the cache, bad input."""

import numpy as np
import pytest

from megatron_lc.config import ConfigError, parse_config
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
