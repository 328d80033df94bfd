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
    ("examples/pretrain_llama_70b.sh", [], 32),
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
                                    "examples/mpirun_pretrain.sh", "examples/pretrain_llama_70b.sh"])
def test_the_nvls_export_says_why_in_one_line(script):
    lines = (REPO / script).read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("export NCCL_NVLS_ENABLE="))
    assert lines[i - 1].startswith("# NVLS") and "memory plan" in lines[i - 1]


def test_70b_recipe_launches_4_nodes_of_8_with_a_rendezvous(tmp_path):
    argv = _recorded_launch("examples/pretrain_llama_70b.sh", ["corpus", "tokenizer.model", str(tmp_path / "c")],
                            tmp_path, {"MASTER_ADDR": "node0"})["argv"]
    launcher = argv[:argv.index("-m")]
    assert launcher[launcher.index("--nnodes") + 1] == "4" and launcher[launcher.index("--nproc-per-node") + 1] == "8"
    assert launcher[launcher.index("--rdzv-endpoint") + 1] == "node0:29500"
