"""The launch recipes in examples/ pass flags the trainer accepts and a configuration it validates.

Each script runs with fake torchrun / srun / mpirun / python on PATH that record the command
line; the trainer's flags are then parsed and validated as the real launch would (world size
from the recipe), with placeholder data files.
"""

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from megatron_lc.config import parse_config

REPO = Path(__file__).resolve().parents[2]
RECORDER = """#!/usr/bin/env python3
import json, os, sys
with open({out!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "nvls": os.environ.get("NCCL_NVLS_ENABLE")}}) + "\\n")
"""
RECIPES = [
    ("examples/pretrain_llama_5m.sh", [], 8),
    ("examples/pretrain_llama_3m.sh", [], 8),
    ("examples/pretrain_llama_7m.sh", [], 8),
    ("examples/slurm/pretrain_llama_8m_2nodes.sbatch", [], 16),
    ("examples/mpirun_pretrain.sh", ["hosts"], 8),
]


def _recorded_launch(script: str, args: list[str], tmp_path: Path, env: dict | None = None) -> dict:
    """The launcher's command line and the NCCL_NVLS_ENABLE it saw."""
    bin_dir, out = tmp_path / "bin", tmp_path / "argv.jsonl"
    bin_dir.mkdir(exist_ok=True)
    for name in ("torchrun", "srun", "mpirun", "python", "scontrol"):
        fake = bin_dir / name
        fake.write_text(RECORDER.format(out=str(out)))
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**{k: v for k, v in os.environ.items() if k != "NCCL_NVLS_ENABLE"}, **(env or {}),
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node1"}
    subprocess.run(["bash", str(REPO / script), *args], env=env, check=True, timeout=60, cwd=tmp_path)
    return [json.loads(line) for line in out.read_text().splitlines()][-1]


def _recorded_train_args(script: str, args: list[str], tmp_path: Path) -> list[str]:
    argv = _recorded_launch(script, args, tmp_path)["argv"]
    return argv[argv.index("megatron_lc.train") + 1:]


@pytest.mark.parametrize("script, leading, world_size", RECIPES)
def test_recipe_flags_parse_and_validate(script, leading, world_size, tmp_path):
    data = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        Path(f"{data}{suffix}").write_bytes(b"")
    args = _recorded_train_args(script, [*leading, str(data), "tokenizer.model", str(tmp_path / "ckpt")], tmp_path)
    cfg = parse_config(args)
    cfg.data.tokenizer_type = None  # the Llama 3 tokenizer file is not here; its vocabulary is the flavour's
    cfg.validate(world_size)
    assert cfg.checkpoint.save and cfg.train.exit_signal_handler


@pytest.mark.parametrize("script, leading, world_size", RECIPES)
def test_recipe_turns_nvls_off_unless_the_user_chose(script, leading, world_size, tmp_path):
    """NCCL_NVLS_ENABLE=0 reaches the launcher (and, under mpirun, is forwarded with -x to every rank)."""
    args = [*leading, "corpus", "tokenizer.model", str(tmp_path / "ckpt")]
    launch = _recorded_launch(script, args, tmp_path)
    assert launch["nvls"] == "0"
    if "mpirun" in script:
        assert launch["argv"][launch["argv"].index("NCCL_NVLS_ENABLE") - 1] == "-x"
    assert _recorded_launch(script, args, tmp_path, {"NCCL_NVLS_ENABLE": "1"})["nvls"] == "1"


@pytest.mark.parametrize("script", ["examples/pretrain_llama_5m.sh", "examples/slurm/pretrain_llama_8m_2nodes.sbatch",
                                    "examples/mpirun_pretrain.sh"])
def test_the_nvls_export_says_why_in_one_line(script):
    lines = (REPO / script).read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("export NCCL_NVLS_ENABLE="))
    assert lines[i - 1].startswith("# NVLS") and "memory plan" in lines[i - 1]


def _recorded_launches(script: str, args: list[str], tmp_path: Path, env: dict | None = None) -> list[list[str]]:
    """Every command line the recipe launched, in order."""
    _recorded_launch(script, args, tmp_path, env)
    return [json.loads(line)["argv"] for line in (tmp_path / "argv.jsonl").read_text().splitlines()]


def _module_args(launches: list[list[str]], module: str) -> list[list[str]]:
    return [argv[argv.index(module) + 1:] for argv in launches if module in argv]


def _validated(args: list[str], world_size: int, data: Path):
    cfg = parse_config([a if a != "DATA" else str(data) for a in args])
    cfg.data.tokenizer_type = None  # the model's tokenizer is not here; its vocabulary is the checkpoint's
    cfg.checkpoint.use_checkpoint_args = False  # no converted checkpoint to read the shape from
    cfg.validate(world_size)
    return cfg


def test_the_extension_recipe_resets_positions_with_attention_at_every_stage(tmp_path):
    data = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):
        Path(f"{data}{suffix}").write_bytes(b"")
    (tmp_path / "w").mkdir()  # the recipe's outputs (the recorded launchers write none)
    launches = _recorded_launches("examples/extend_llama3_8b.sh", ["hf", str(data), "tok", str(tmp_path / "w")],
                                  tmp_path)
    stages = _module_args(launches, "megatron_lc.train")
    assert len(stages) == 3
    for args in stages:  # each document attends to itself from position 0, as the model was pretrained
        assert "--reset-attention-mask" in args and "--reset-position-ids" in args
        _validated(args + ["--model", "llama3-8b"], 8, data)


def test_the_chat_fine_tuning_recipe_packs_1m_token_samples_and_evaluates_the_same_part(tmp_path):
    work = tmp_path / "w"
    (work / "data").mkdir(parents=True)
    data = work / "data" / "sft_messages_document"
    for suffix in (".bin", ".idx"):
        Path(f"{data}{suffix}").write_bytes(b"")
    launches = _recorded_launches("examples/sft_llama3_8b_long.sh", ["Llama-3.1-8B-Instruct", "chat.jsonl", str(work)],
                                  tmp_path)
    preprocess = next(argv for argv in launches if argv[0].endswith("preprocess_data.py"))
    assert preprocess[preprocess.index("--json-keys") + 1] == "messages" and "--chat-template" in preprocess
    (train,) = _module_args(launches, "megatron_lc.train")
    cfg = _validated(train + ["--model", "llama3-8b"], 8, data)
    assert cfg.packing.packing == "documents" and cfg.data.seq_length == 1_048_576 and cfg.checkpoint.finetune
    assert cfg.parallel.context_parallel_size == 8 and cfg.train.bf16 and cfg.checkpoint.save
    (evaluate,) = _module_args(launches, "megatron_lc.evaluate")
    from megatron_lc.evaluate import build_parser

    evaluated = build_parser().parse_args(evaluate)
    assert (evaluated.packing, evaluated.split, evaluated.split_part, evaluated.seq_length) == \
        ("documents", cfg.data.split, "valid", cfg.data.seq_length)
    assert launches[-1][0].endswith("convert_to_hf.py")
