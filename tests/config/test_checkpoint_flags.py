"""--no-save-optim, --no-save-rng, --exit-on-missing-checkpoint, --ckpt-step and --finetune, through the trainer."""

import json

import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training.preflight import preflight
from megatron_lc.training import checkpointing
from megatron_lc.training.trainer import train
from tests.helpers import train_flags

BASE = train_flags("--train-iters", "4", tiny_model=True)


def _run(tmp_path, name, *flags):
    return train(parse_config(BASE + ["--log-dir", str(tmp_path / name), *flags]))


def test_checkpoint_without_optimizer_resumes_with_a_fresh_one_as_no_load_optim(tmp_path, capsys):
    _run(tmp_path, "a", "--save", str(tmp_path / "full"), "--exit-interval", "2")
    _run(tmp_path, "b", "--save", str(tmp_path / "lean"), "--exit-interval", "2", "--no-save-optim", "--no-save-rng")
    lean = checkpointing.checkpoint_dir(tmp_path / "lean", 2)
    meta = json.loads((lean / "meta.json").read_text())
    assert meta["optimizer_saved"] is False and meta["rng_saved"] is False and "weights_only" not in meta
    assert not list(lean.glob("rng_rank*.json")) and list(checkpointing.checkpoint_dir(tmp_path / "full", 2)
                                                           .glob("rng_rank*.json"))
    fresh = _run(tmp_path, "c", "--load", str(tmp_path / "full"), "--no-load-optim")
    capsys.readouterr()
    resumed = _run(tmp_path, "d", "--load", str(tmp_path / "lean"))
    out = capsys.readouterr().out
    assert "holds no optimizer state (saved with --no-save-optim)" in out and "saved with --no-save-rng" in out
    assert [m["step"] for m in resumed] == [3, 4]  # the step and data position are kept
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in fresh], rel=1e-6)


def test_missing_checkpoint_stops_the_run_instead_of_starting_from_scratch(tmp_path):
    (tmp_path / "typo").mkdir()
    with pytest.raises(ConfigError, match=r"^--exit-on-missing-checkpoint: --load .*typo holds no checkpoint"):
        preflight(parse_config(BASE + ["--load", str(tmp_path / "typo"), "--exit-on-missing-checkpoint"]))
    with pytest.raises(ConfigError, match="--exit-on-missing-checkpoint reads the checkpoint in --load"):
        parse_config(BASE + ["--exit-on-missing-checkpoint"]).validate(1)


def test_ckpt_step_loads_that_step_not_the_newest(tmp_path):
    whole = _run(tmp_path, "whole", "--save", str(tmp_path / "ckpt"), "--save-interval", "2")
    assert checkpointing.latest_checkpoint(tmp_path / "ckpt").name == "iter_0000004"
    again = _run(tmp_path, "again", "--load", str(tmp_path / "ckpt"), "--ckpt-step", "2")
    assert [m["step"] for m in again] == [3, 4]
    assert [m["loss"] for m in again] == pytest.approx([m["loss"] for m in whole[2:]], rel=1e-6)
    with pytest.raises(ConfigError, match=r"^--ckpt-step 3: no checkpoint of step 3 in --load"):
        preflight(parse_config(BASE + ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "3"]))


def test_finetune_from_a_load_with_no_checkpoint_is_refused_naming_a_hugging_face_directory(tmp_path):
    """A mistyped --load would fine-tune random weights: refused before any work, exit 2 through the entry point;
    a Hugging Face model there is named with the command that converts it."""
    import subprocess
    import sys

    with pytest.raises(ConfigError, match=r"^--finetune: --load .*typo holds no checkpoint .*a typo in the path"):
        preflight(parse_config(BASE + ["--load", str(tmp_path / "typo"), "--finetune"]))
    from tests.helpers import hf_model_files

    hf = hf_model_files(tmp_path / "Llama-3.1-8B-Instruct")
    with pytest.raises(ConfigError, match=r"it is a Hugging Face model: convert it with python "
                                          r"tools/checkpoint/convert_from_hf.py --load .*Instruct --save CKPT"):
        preflight(parse_config(BASE + ["--load", hf, "--finetune"]))
    out = subprocess.run([sys.executable, "-m", "megatron_lc.train", *BASE, "--load", str(tmp_path / "typo"),
                          "--finetune"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "--finetune: --load" in out.stderr
    _run(tmp_path, "a", "--save", str(tmp_path / "ckpt"), "--train-iters", "1")
    preflight(parse_config(BASE + ["--load", str(tmp_path / "ckpt"), "--finetune"]))  # a checkpoint: accepted
