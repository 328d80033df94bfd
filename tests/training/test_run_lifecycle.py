"""What a cluster job relies on: exit statuses, preemption, damaged checkpoints, resume semantics, presets."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training.preflight import preflight
from megatron_lc.data.indexed_dataset import IndexedDatasetBuilder
from megatron_lc.training import checkpointing
from megatron_lc.training.logging import format_duration
from megatron_lc.training.trainer import train
from tests.helpers import free_port, train_flags

BASE = train_flags("--seq-length", "32")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _torchrun_cmd(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", "-m", "megatron_lc.train", *args]


def _train_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_lc.train", *args]


def _steps(log_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_finished_two_process_runs_exit_zero_every_time(tmp_path):
    for i in range(3):
        out = subprocess.run(_torchrun_cmd(2, BASE + ["--train-iters", "2", "--log-dir", f"run{i}"]), env=ENV,
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "terminate called" not in out.stderr


def test_configuration_error_is_one_line_from_rank_zero_with_status_two(tmp_path):
    out = subprocess.run(_torchrun_cmd(2, BASE + ["--context-parallel-size", "2", "--seq-length", "33"]), env=ENV,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    ours = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert ours == ["error: --seq-length 33 is not divisible by 2 (--context-parallel-size 2); use a multiple of 2"]
    assert "exitcode  : 2" in out.stderr  # torchrun's own summary of the worker's status
    single = subprocess.run(_train_cmd(BASE + ["--min-lr", "1"]), env=ENV, cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert single.returncode == 2 and single.stderr.strip().splitlines() == [
        "error: --min-lr 1.0 is above --lr 0.003: the rate would rise while it decays"]


def test_exit_duration_saves_and_stops(tmp_path):
    """A step is started only if it can finish and save before the deadline (tests/training/test_stop_to_resume.py)."""
    history = train(parse_config(BASE + ["--train-iters", "100000", "--exit-duration-in-mins", "0.2",
                                         "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "log")]))
    assert history.stopped and "--exit-duration-in-mins 0.2" in history.stopped and 1 <= len(history) < 100000
    assert checkpointing.read_meta(checkpointing.latest_checkpoint(tmp_path / "ckpt"))["step"] == history[-1]["step"]


def _three_checkpoints(tmp_path) -> tuple[Path, list[float]]:
    ckpt = tmp_path / "ckpt"
    history = train(parse_config(BASE + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1",
                                         "--keep-last-checkpoints", "3", "--log-dir", str(tmp_path / "whole")]))
    return ckpt, [m["loss"] for m in history]


def _damage_shard(path: Path) -> None:
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])


@pytest.mark.parametrize("damage", ["truncated shard", "empty marker", "bad meta", "missing metadata"])
def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, damage):
    ckpt, losses = _three_checkpoints(tmp_path)
    newest = checkpointing.checkpoint_dir(ckpt, 3)
    if damage == "truncated shard":
        _damage_shard(newest)
    elif damage == "empty marker":
        (ckpt / checkpointing.LATEST).write_text("")
    elif damage == "bad meta":
        (newest / checkpointing.META).write_text('{"step": 3, ')
    else:
        (newest / ".metadata").unlink()
    if damage == "empty marker":  # the directories still tell which is newest
        assert checkpointing.latest_checkpoint(ckpt) == newest
        return
    with pytest.warns(UserWarning, match=f"skipping damaged checkpoint iter_0000003: .*{newest.name}"):
        assert checkpointing.latest_checkpoint(ckpt) == checkpointing.checkpoint_dir(ckpt, 2)
    with pytest.warns(UserWarning):
        resumed = train(parse_config(BASE + ["--train-iters", "3", "--load", str(ckpt),
                                             "--log-dir", str(tmp_path / "resumed")]))
    assert [m["loss"] for m in resumed] == pytest.approx(losses[2:], rel=1e-6)


def test_checkpoint_records_every_file_with_its_size(tmp_path):
    ckpt, _ = _three_checkpoints(tmp_path)
    path = checkpointing.checkpoint_dir(ckpt, 1)
    files = checkpointing.read_meta(path)["files"]
    assert files == {p.name: p.stat().st_size for p in path.iterdir() if p.name != checkpointing.META}
    assert ".metadata" in files and any(name.endswith(".distcp") for name in files)


def test_load_of_an_empty_or_missing_directory_starts_from_scratch(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for load in ("empty", "missing"):
        history = train(parse_config(BASE + ["--train-iters", "1", "--load", str(tmp_path / load),
                                             "--log-dir", str(tmp_path / load / "log")]))
        assert [m["step"] for m in history] == [1]
        assert "no checkpoint there yet; training starts from scratch" in capsys.readouterr().out


def test_unwritable_save_directory_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=f"--save {blocker}/ckpt: not writable"):
        preflight(parse_config(BASE + ["--save", str(blocker / "ckpt")]))


def _lrs(log_dir: Path) -> list[float]:
    return [json.loads(line)["lr"] for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_changed_schedule_on_resume_is_refused_unless_a_flag_chooses(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train(parse_config(BASE + ["--train-iters", "4", "--save", ckpt, "--exit-interval", "2",
                               "--log-dir", str(tmp_path / "a")]))
    changed = BASE + ["--lr", "1e-3", "--min-lr", "1e-4", "--train-iters", "4", "--load", ckpt]
    with pytest.raises(ConfigError, match="another learning-rate schedule .*--override-opt_param-scheduler"):
        train(parse_config(changed + ["--log-dir", str(tmp_path / "b")]))
    train(parse_config(changed + ["--override-opt_param-scheduler", "--log-dir", str(tmp_path / "new")]))
    train(parse_config(changed + ["--use-checkpoint-opt_param-scheduler", "--log-dir", str(tmp_path / "old")]))
    new_whole = train(parse_config(changed[:-2] + ["--log-dir", str(tmp_path / "nw")]))
    old_whole = train(parse_config(BASE + ["--train-iters", "4", "--log-dir", str(tmp_path / "ow")]))
    assert _lrs(tmp_path / "new") == [m["lr"] for m in new_whole][2:]
    assert _lrs(tmp_path / "old") == [m["lr"] for m in old_whole][2:]


def test_mock_data_at_another_length_on_resume_is_refused_unless_overridden(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    train(parse_config(BASE + ["--train-iters", "2", "--save", ckpt, "--log-dir", str(tmp_path / "a")]))
    with pytest.raises(ConfigError, match=r"read at --seq-length 32 x 1 samples per step \(2 samples consumed\), "
                                          "this run reads 64 x 1, and mock data is no token stream.*"
                                          "--override-data-settings"):
        train(parse_config(BASE + ["--seq-length", "64", "--train-iters", "3", "--load", ckpt]))
    capsys.readouterr()
    rest = train(parse_config(BASE + ["--seq-length", "64", "--train-iters", "3", "--load", ckpt,
                                      "--override-data-settings", "--override-opt_param-scheduler",
                                      "--log-dir", str(tmp_path / "b")]))
    assert [m["step"] for m in rest] == [3] and "continuing by sample count" in capsys.readouterr().out


def test_a_longer_seq_length_on_resume_continues_the_token_stream(tmp_path, capsys):
    """4K -> 8K -> 16K in miniature through the trainer: the step and the schedule go on, each phase starts at the
    first token the previous ones did not train, and says so."""
    _write_dataset(tmp_path / "a", 0)
    data = [a for a in BASE if a != "--mock-data"] + [  # each phase gives its --seq-length
        "--data-path", str(tmp_path / "a"), "--split", "100,0,0", "--train-iters", "6", "--lr-decay-iters", "6",
        "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    lengths = {"16": "2", "32": "4", "64": "6"}
    steps, said = [], []
    for seq_length, until in lengths.items():
        capsys.readouterr()
        history = train(parse_config(data + ["--seq-length", seq_length, "--exit-interval", until,
                                             "--log-dir", str(tmp_path / seq_length)]))
        steps += [m["step"] for m in history]
        said.append(capsys.readouterr().out)
    assert steps == [1, 2, 3, 4, 5, 6]
    assert "continues at token 32, the first not yet trained" in said[1]  # 2 steps x 16 tokens
    assert "continues at token 96, the first not yet trained" in said[2]  # 32 + 2 steps x 32 tokens
    meta = checkpointing.newest_intact_checkpoint(tmp_path / "ckpt")[1]
    assert meta["data"]["stream_position"] == [96 + 2 * 64] and meta["data"]["stream_start"] == [96]


def test_finetune_loads_weights_and_starts_at_step_zero(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train(parse_config(BASE + ["--train-iters", "2", "--save", ckpt, "--log-dir", str(tmp_path / "a")]))
    tuned = train(parse_config(BASE + ["--seq-length", "64", "--train-iters", "2", "--load", ckpt, "--finetune",
                                       "--log-dir", str(tmp_path / "b")]))
    fresh = train(parse_config(BASE + ["--seq-length", "64", "--train-iters", "2", "--log-dir", str(tmp_path / "c")]))
    assert [m["step"] for m in tuned] == [1, 2]
    assert tuned[0]["loss"] != pytest.approx(fresh[0]["loss"], rel=1e-3)  # trained weights, not new ones


def test_no_load_optim_continues_the_step_with_a_fresh_optimizer(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    whole = train(parse_config(BASE + ["--train-iters", "3", "--log-dir", str(tmp_path / "w")]))
    train(parse_config(BASE + ["--train-iters", "3", "--save", ckpt, "--exit-interval", "2",
                               "--log-dir", str(tmp_path / "a")]))
    rest = train(parse_config(BASE + ["--train-iters", "3", "--load", ckpt, "--no-load-optim",
                                      "--log-dir", str(tmp_path / "b")]))
    assert [m["step"] for m in rest] == [3]
    assert rest[0]["loss"] == pytest.approx(whole[2]["loss"], rel=1e-6)  # same weights: same loss at step 3


def test_use_checkpoint_args_takes_the_model_shape_from_the_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train(parse_config(BASE + ["--num-layers", "1", "--train-iters", "1", "--save", ckpt,
                               "--log-dir", str(tmp_path / "a")]))
    history = train(parse_config(BASE + ["--train-iters", "2", "--load", ckpt, "--use-checkpoint-args",
                                         "--override-opt_param-scheduler", "--log-dir", str(tmp_path / "b")]))
    assert [m["step"] for m in history] == [2]


def test_preset_values_are_typed_and_checked_like_flags(tmp_path):
    preset = tmp_path / "run.yaml"
    preset.write_text("optim:\n  lr: 3e-4\ndata:\n  mock_data: true\n  data_path: [a, b]\n")
    cfg = parse_config(["--config", str(preset)])
    assert cfg.optim.lr == 3e-4 and cfg.data.data_path == ["a", "b"]
    preset.write_text("cp_impl: bogus\n")
    with pytest.raises(ConfigError, match=f"--config {preset}: argument --cp-impl: invalid choice: 'bogus'"):
        parse_config(["--config", str(preset)])
    preset.write_text("mock_data: 1\n")
    with pytest.raises(ConfigError, match="mock_data must be true or false"):
        parse_config(["--config", str(preset)])
    preset.write_text("no_such_setting: 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'no_such_setting'"):
        parse_config(["--config", str(preset)])


def test_progress_line_shows_elapsed_time_and_eta(tmp_path, capsys):
    train(parse_config(BASE + ["--train-iters", "3", "--log-dir", str(tmp_path)]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert len(lines) == 3 and all(" ETA " in line for line in lines) and lines[-1].endswith("ETA 0s")
    assert [format_duration(s) for s in (7, 185, 7260)] == ["7s", "3m05s", "2h01m"]


def test_resume_past_train_iters_says_so_and_does_nothing(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    train(parse_config(BASE + ["--train-iters", "1", "--save", ckpt, "--log-dir", str(tmp_path / "a")]))
    assert train(parse_config(BASE + ["--train-iters", "1", "--load", ckpt])) == []
    assert "nothing left to do" in capsys.readouterr().out


def test_saving_into_a_directory_with_later_checkpoints_keeps_the_new_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    train(parse_config(BASE + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1",
                               "--keep-last-checkpoints", "3", "--log-dir", str(tmp_path / "a")]))
    train(parse_config(BASE + ["--seq-length", "64", "--train-iters", "1", "--save", str(ckpt), "--load", str(ckpt),
                               "--finetune", "--log-dir", str(tmp_path / "b")]))
    steps = sorted(p.name for p in ckpt.glob("iter_*"))
    assert steps == ["iter_0000001", "iter_0000002", "iter_0000003"]  # the new step 1 replaced the old one
    assert checkpointing.latest_checkpoint(ckpt) == checkpointing.checkpoint_dir(ckpt, 1)
    assert checkpointing.read_meta(checkpointing.checkpoint_dir(ckpt, 1))["train_config"]["data"]["seq_length"] == 64


def test_pruning_keeps_the_newest_earlier_checkpoints(tmp_path):
    ckpt, _ = _three_checkpoints(tmp_path)
    train(parse_config(BASE + ["--train-iters", "4", "--save", str(ckpt), "--load", str(ckpt),
                               "--override-opt_param-scheduler", "--keep-last-checkpoints", "2",
                               "--log-dir", str(tmp_path / "more")]))
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000003", "iter_0000004"]


@pytest.mark.parametrize("text, message", [
    ("lr: [1, 2\n", "not valid YAML"),
    ("- lr\n", "expected settings by name at the top level"),
    ("seq_length: [1, 2]\n", "2 left over: a list given to a setting that takes one value"),
])
def test_broken_presets_are_one_line_errors_naming_the_file(tmp_path, text, message):
    preset = tmp_path / "run.yaml"
    preset.write_text(text)
    with pytest.raises(ConfigError, match=message):
        parse_config(["--config", str(preset)])
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(ConfigError, match="expected a .yaml, .yml or .toml file"):
        parse_config(["--config", str(tmp_path / "run.json")])


@pytest.mark.parametrize("flags, message", [
    (["--eval-interval", "1", "--split", "98,2,0"], "--eval-interval 1 needs validation data"),
    (["--use-checkpoint-args"], "--use-checkpoint-args reads the checkpoint in --load"),
])
def test_validation_and_checkpoint_flags_without_what_they_read_are_refused(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        train(parse_config(BASE + flags + ["--log-dir", str(tmp_path)]))


def test_each_rank_saves_and_restores_its_own_generators(tmp_path):
    import torch

    ckpt = tmp_path / "ckpt"
    train(parse_config(BASE + ["--train-iters", "1", "--save", str(ckpt), "--log-dir", str(tmp_path / "a")]))
    path = checkpointing.latest_checkpoint(ckpt)
    saved = json.loads((path / checkpointing.rng_file_name(0)).read_text())
    torch.manual_seed(12345)
    assert checkpointing.load_rng_state(path, 0) and torch.get_rng_state().tolist() == saved["torch"]
    assert not checkpointing.load_rng_state(path, 1)  # a rank the checkpoint did not have


def _write_dataset(prefix: Path, seed: int, documents: int = 40) -> None:
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        for _ in range(documents):
            builder.add_item(rng.integers(1, 500, size=int(rng.integers(20, 60))))
            builder.end_document()
        builder.finalize(f"{prefix}.idx")


def test_resume_compares_data_by_content_not_by_path(tmp_path, monkeypatch):
    """A moved copy with its weights written otherwise resumes exactly; other data behind the same path is
    refused in one line; --override-data-settings continues deliberately, keeping the step."""
    for name, seed in (("a", 0), ("b", 1)):
        _write_dataset(tmp_path / name, seed)
    data = [a for a in BASE if a != "--mock-data"] + ["--split", "100,0,0", "--train-iters", "4"]
    blend = ["--data-path", "0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b")]
    whole = train(parse_config(data + blend + ["--log-dir", str(tmp_path / "w")]))
    ckpt = str(tmp_path / "ckpt")
    train(parse_config(data + blend + ["--save", ckpt, "--exit-interval", "2", "--log-dir", str(tmp_path / "x")]))
    moved = tmp_path / "nvme"
    moved.mkdir()
    for name in ("a", "b"):
        for ext in (".bin", ".idx"):
            shutil.copy(tmp_path / f"{name}{ext}", moved / f"{name}{ext}")
    monkeypatch.chdir(moved)  # relative prefixes, weights as percentages
    rest = train(parse_config(data + ["--data-path", "70", "a", "30", "b", "--load", ckpt,
                                      "--log-dir", str(tmp_path / "r")]))
    assert [m["step"] for m in rest] == [3, 4]
    assert [m["loss"] for m in rest] == pytest.approx([m["loss"] for m in whole[2:]], rel=1e-6)
    _write_dataset(moved / "a", 7)  # other data behind the same path
    with pytest.raises(ConfigError, match=r"--data-path a: .* in the checkpoint, .* now.*--override-data-settings"):
        train(parse_config(data + ["--data-path", "70", "a", "30", "b", "--load", ckpt]))
    overridden = train(parse_config(data + ["--data-path", "70", "a", "30", "b", "--load", ckpt,
                                            "--override-data-settings", "--log-dir", str(tmp_path / "o")]))
    assert [m["step"] for m in overridden] == [3, 4]
