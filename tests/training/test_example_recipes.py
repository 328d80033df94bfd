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
import json, sys
with open({out!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _recorded_train_args(script: str, args: list[str], tmp_path: Path) -> list[str]:
    bin_dir, out = tmp_path / "bin", tmp_path / "argv.jsonl"
    bin_dir.mkdir()
    for name in ("torchrun", "srun", "mpirun", "python", "scontrol"):
        fake = bin_dir / name
        fake.write_text(RECORDER.format(out=str(out)))
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node1"}
    subprocess.run(["bash", str(REPO / script), *args], env=env, check=True, timeout=60, cwd=tmp_path)
    argv = [json.loads(line) for line in out.read_text().splitlines()][-1]
    return argv[argv.index("megatron_lc.train") + 1:]


@pytest.mark.parametrize("script, leading, world_size", [
    ("examples/pretrain_llama_5m.sh", [], 8),
    ("examples/pretrain_llama_3m.sh", [], 8),
    ("examples/pretrain_llama_7m.sh", [], 8),
    ("examples/slurm/pretrain_llama_8m_2nodes.sbatch", [], 16),
    ("examples/mpirun_pretrain.sh", ["hosts"], 8),
])
def test_recipe_flags_parse_and_validate(script, leading, world_size, tmp_path):
    data = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        Path(f"{data}{suffix}").write_bytes(b"")
    args = _recorded_train_args(script, [*leading, str(data), "tokenizer.model", str(tmp_path / "ckpt")], tmp_path)
    cfg = parse_config(args)
    cfg.data.tokenizer_type = None  # the Llama 3 tokenizer file is not here; its vocabulary is the flavour's
    cfg.validate(world_size)
    assert cfg.checkpoint.save and cfg.train.exit_signal_handler
