"""--data-args-path, --per-split-data-args-path (Megatron-LM's file formats) and --num-workers, through the trainer."""

import json

import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training.trainer import train
from tests.helpers import TINY_MODEL_FLAGS, write_random_dataset

MODEL = [*TINY_MODEL_FLAGS, "--vocab-size", "128", "--device", "cpu", "--lr", "3e-3", "--train-iters", "3"]


def _dataset(prefix, seed: int) -> str:
    return write_random_dataset(prefix, documents=20, lengths=(10, 40), vocab=128, seed=seed)


def _losses(tmp_path, name, *flags):
    return [m["loss"] for m in train(parse_config(MODEL + ["--log-dir", str(tmp_path / name), *flags]))]


def test_data_args_file_trains_exactly_as_the_same_words_on_the_command_line(tmp_path):
    a, b = _dataset(tmp_path / "a", 0), _dataset(tmp_path / "b", 1)
    (tmp_path / "blend.txt").write_text(f"0.6 {a}\n0.4\n{b}\n")
    inline = _losses(tmp_path, "inline", "--data-path", "0.6", a, "0.4", b)
    from_file = _losses(tmp_path, "file", "--data-args-path", str(tmp_path / "blend.txt"))
    assert from_file == inline


def test_per_split_file_takes_strings_or_lists_as_megatron_reads_them(tmp_path):
    a, b = _dataset(tmp_path / "a", 0), _dataset(tmp_path / "b", 1)
    (tmp_path / "splits.json").write_text(json.dumps({"train": f"0.5 {a} 0.5 {b}", "valid": [b], "test": None}))
    inline = train(parse_config(MODEL + ["--train-data-path", "0.5", a, "0.5", b, "--valid-data-path", b,
                                         "--eval-interval", "3", "--log-dir", str(tmp_path / "i")]))
    from_file = train(parse_config(MODEL + ["--per-split-data-args-path", str(tmp_path / "splits.json"),
                                            "--eval-interval", "3", "--log-dir", str(tmp_path / "f")]))
    assert [m["loss"] for m in from_file] == [m["loss"] for m in inline]
    assert from_file[-1]["val_loss"] == inline[-1]["val_loss"]


@pytest.mark.parametrize("content, flags, message", [
    ("{", ["--per-split-data-args-path"], "not valid JSON"),
    ('{"train": "x", "validation": "y"}', ["--per-split-data-args-path"], "expected an object with keys train, valid"),
    ('{"train": {"a": 1}}', ["--per-split-data-args-path"], "train must be a string or a list"),
    ("", ["--data-args-path"], "the file is empty"),
])
def test_a_data_args_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, content, flags, message):
    path = tmp_path / "args"
    path.write_text(content)
    with pytest.raises(ConfigError, match=rf"^{flags[0]} {path}: {message}"):
        parse_config(MODEL + [*flags, str(path)]).validate(1)
    with pytest.raises(ConfigError, match="cannot be read"):
        parse_config(MODEL + [flags[0], str(tmp_path / "missing")]).validate(1)


def test_data_args_file_and_data_path_together_are_refused(tmp_path):
    a = _dataset(tmp_path / "a", 0)
    (tmp_path / "blend.txt").write_text(a)
    with pytest.raises(ConfigError, match="holds --data-path's words: give one of the two"):
        parse_config(MODEL + ["--data-path", a, "--data-args-path", str(tmp_path / "blend.txt")]).validate(1)


def test_worker_processes_read_the_same_batches_and_resume_exactly(tmp_path):
    a = _dataset(tmp_path / "a", 0)
    data = ["--data-path", a, "--train-iters", "4"]
    plain = _losses(tmp_path, "plain", *data)
    workers = _losses(tmp_path, "workers", *data, "--num-workers", "2")
    assert workers == plain
    first = _losses(tmp_path, "first", *data, "--num-workers", "2", "--save", str(tmp_path / "c"),
                    "--exit-interval", "2")
    rest = _losses(tmp_path, "rest", *data, "--num-workers", "2", "--load", str(tmp_path / "c"))
    assert first + rest == pytest.approx(plain, rel=1e-6)
    with pytest.raises(ConfigError, match="--num-workers -1 must be >= 0"):
        parse_config(MODEL + data + ["--num-workers", "-1"]).validate(1)


def test_workers_fork_once_before_anything_is_page_locked(tmp_path, monkeypatch):
    """--num-workers forks worker processes; a fork after the offload arenas are page-locked (cudaHostRegister,
    up to a terabyte) copies or shares them in every worker. Every loader's workers (training, validation, test)
    fork before the first arena exists (where a CUDA run page-locks it), and neither evaluation nor a resume
    forks again."""
    import multiprocessing.process

    from megatron_lc.memory.offload import OffloadScheduler

    events, fork, arena = [], multiprocessing.process.BaseProcess.start, OffloadScheduler._new_arena

    def recording_fork(process):
        events.append("fork")
        return fork(process)

    def recording_arena(scheduler, *args, **kwargs):
        events.append("arena")
        return arena(scheduler, *args, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_fork)
    monkeypatch.setattr(OffloadScheduler, "_new_arena", recording_arena)
    a = write_random_dataset(tmp_path / "a", documents=60, lengths=(10, 40), vocab=128)
    flags = ["--data-path", a, "--split", "80,10,10", "--eval-interval", "1", "--eval-iters", "1",
             "--recompute-granularity", "full", "--offload-activations", "--num-workers", "2"]
    plain = _losses(tmp_path, "plain", *flags[:-2], "--train-iters", "4")
    assert "fork" not in events
    for name, extra in (("first", ["--save", str(tmp_path / "c"), "--exit-interval", "2"]),
                        ("rest", ["--load", str(tmp_path / "c")])):
        events.clear()
        losses = _losses(tmp_path, name, *flags, "--train-iters", "4", *extra)
        assert losses == pytest.approx(plain[:2] if name == "first" else plain[2:], rel=1e-6)
        assert events[:6] == ["fork"] * 6 and "fork" not in events[6:] and "arena" in events[6:]
