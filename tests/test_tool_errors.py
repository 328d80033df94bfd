"""Every command line, given input that cannot work, answers with one line on stderr and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
TRAIN = ["-m", "megatron_lc.train", "--mock-data", "--seq-length", "64", "--train-iters", "1", "--device", "cpu"]

# (name, command after the interpreter, words the line must hold); {tmp} is a fresh directory, {file} a file in it.
CASES = [
    ("estimate: unknown model", ["tools/estimate_memory.py", "--model", "nope"], "--model 'nope'"),
    ("estimate: cp 3 on 8 GPUs", ["tools/estimate_memory.py", "--context-parallel-size", "3", "--num-gpus", "8"],
     "--context-parallel-size 3"),
    ("estimate: no GPUs", ["tools/estimate_memory.py", "--num-gpus", "0"], "--num-gpus 0"),
    ("estimate: zero length", ["tools/estimate_memory.py", "--seq-length", "0"], "--seq-length 0"),
    ("estimate: negative memory", ["tools/estimate_memory.py", "--gpu-memory-gib", "-1"], "--gpu-memory-gib -1"),
    ("estimate: abbreviated flag", ["tools/estimate_memory.py", "--seq", "1024"], "unrecognized arguments: --seq"),
    ("from_hf: no directory", ["tools/checkpoint/convert_from_hf.py", "--load", "{tmp}/none", "--save", "{tmp}/c"],
     "no such directory"),
    ("to_hf: no checkpoint", ["tools/checkpoint/convert_to_hf.py", "--load", "{tmp}/none", "--save", "{tmp}/hf"],
     "--load"),
    ("evaluate: no checkpoint", ["-m", "megatron_lc.evaluate", "--load", "{tmp}", "--data-path", "{tmp}/d",
                                 "--seq-length", "8", "--device", "cpu"], "no intact checkpoint"),
    ("preprocess: no input", ["tools/preprocess_data.py", "--input", "{tmp}/none.jsonl", "--output-prefix",
                              "{tmp}/o", "--tokenizer-type", "ByteTokenizer"], "no such file"),
    ("preprocess: unwritable output", ["tools/preprocess_data.py", "--input", "{file}", "--output-prefix",
                                       "{file}/sub/o", "--tokenizer-type", "ByteTokenizer"], "not writable"),
    ("tokenizer: no input", ["tools/train_tokenizer.py", "--input", "{tmp}/none", "--output-prefix", "{tmp}/t"],
     "no such file"),
    ("tokenizer: vocabulary too small", ["tools/train_tokenizer.py", "--input", "{file}", "--output-prefix",
                                         "{tmp}/t", "--vocab-size", "60"], "--vocab-size 60"),
    ("merge: no dataset", ["tools/merge_datasets.py", "--input", "{tmp}/none", "--output-prefix", "{tmp}/m"],
     "--input"),
    ("train: abbreviated flag", [*TRAIN, "--train-it", "2"], "unrecognized arguments: --train-it"),
    ("train: unwritable --log-dir", [*TRAIN, "--log-dir", "{file}/log"], "--log-dir"),
    ("train: unwritable --tensorboard-dir", [*TRAIN, "--tensorboard-dir", "{file}/tb"], "--tensorboard-dir"),
    ("train: unwritable --data-cache-path", [*TRAIN, "--data-cache-path", "{file}/cache"], "--data-cache-path"),
    ("train: --eod-mask-loss without a tokenizer", [*TRAIN, "--eod-mask-loss"], "--tokenizer-type"),
    ("train: tensor parallelism", [*TRAIN, "--tensor-model-parallel-size", "2"], "FSDP2 + context parallelism"),
    ("train: pipeline parallelism", [*TRAIN, "--pipeline-model-parallel-size", "2"], "FSDP2 + context parallelism"),
    ("train: sequence parallelism", [*TRAIN, "--sequence-parallel"], "--context-parallel-size"),
    ("train: distributed optimizer", [*TRAIN, "--use-distributed-optimizer"], "FSDP2 + context parallelism shard"),
]
if not torch.cuda.is_available():
    CASES.append(("train: --device cuda without a GPU", [*TRAIN[:-1], "cuda"], "--device cuda"))


@pytest.mark.parametrize("command,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_line_and_exit_status_2(tmp_path, command, expected):
    file = tmp_path / "corpus.txt"
    file.write_text("some text\n")
    argv = [word.format(tmp=tmp_path, file=file) for word in command]
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "error: " in lines[0] and expected in lines[0], lines[0]
    assert not list(tmp_path.glob("log")) and not (tmp_path / "t.model").exists()
