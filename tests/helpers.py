"""Shared test helpers (multi-process runs and reference batches are `megatron_lc.testing`'s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch.nn as nn
import torch.nn.functional as F

from megatron_lc.data.indexed_dataset import IndexedDatasetBuilder
from megatron_lc.testing import (  # noqa: F401 (the tests' names for them)
    Batch,
    flatten_cu_seqlens,
    free_port,
    make_batch,
    rank_zero_result,
    run_distributed,
    shard_batch,
)


class ResidualMLPBlock(nn.Module):
    """RMSNorm + MLP residual block: its plain autograd keeps several ffn-wide tensors."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.w1, self.w2 = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(self.norm(x))))


def write_random_dataset(prefix, *, documents: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> str:
    """A uint16 `PREFIX.bin/.idx` of `documents` random documents of `lengths` [low, high) tokens with ids in
    [1, vocab); returns the prefix."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        for length in rng.integers(*lengths, size=documents):
            builder.add_item(rng.integers(1, vocab, size=length))
            builder.end_document()
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def write_masked_dataset(prefix, documents, masks=None) -> str:
    """`PREFIX.bin/.idx` of `documents` (lists of ids) and, with `masks` (one 0/1 list per document), its loss
    mask at `PREFIX_loss_mask` as the builder writes any indexed dataset; returns the prefix."""
    from megatron_lc.data.loss_mask import LOSS_MASK_DTYPE, loss_mask_prefix

    for path, rows, dtype in [(str(prefix), documents, np.uint16), (loss_mask_prefix(prefix), masks, LOSS_MASK_DTYPE)]:
        if rows is None:
            continue
        with IndexedDatasetBuilder(f"{path}.bin", dtype=dtype) as builder:
            for row in rows:
                builder.add_item(np.asarray(row, dtype=dtype))
                builder.end_document()
            builder.finalize(f"{path}.idx")
    return str(prefix)


def hf_model_files(path) -> str:
    """A directory with a Hugging Face model's files (config.json, safetensors weights), empty: what a checkpoint
    check should recognise as one. Returns its path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


CP_FIELDS = {"cp_impl": "impl", "heads_per_stage": "heads_per_stage", "untied_overlap": "overlap",
             "untied_backward": "untied_backward", "ring_kv_grads": "ring_kv_grads", "attention_kernel": "kernel",
             "cp_documents": "documents"}
"""The tests' flat names of `ContextParallel`'s fields."""


def parallelize_options(**fields):
    """ParallelizeOptions from one flat set of named fields: the context-parallel spec's (`CP_FIELDS`), the memory
    stack's (`MemoryStack`) and the rest (on the mesh's layout)."""
    import dataclasses as dc

    from megatron_lc.attention.context_parallel import ContextParallel
    from megatron_lc.memory.stack import MemoryStack
    from megatron_lc.models.llama.parallelize import ParallelizeOptions

    memory_names = {f.name for f in dc.fields(MemoryStack)}
    memory = MemoryStack(**{k: v for k, v in fields.items() if k in memory_names})
    cp = ContextParallel(**{CP_FIELDS[k]: v for k, v in fields.items() if k in CP_FIELDS})
    rest = {k: v for k, v in fields.items() if k not in memory_names and k not in CP_FIELDS}
    return ParallelizeOptions(cp=cp, memory=memory, **rest)


TRAIN_FLAGS = ["--mock-data", "--seq-length", "64", "--lr", "3e-3", "--adam-eps", "1e-4", "--device", "cpu"]
"""Flags of a tiny CPU training run (mock data, the debug model) that the trainer tests start from."""

TINY_MODEL_FLAGS = ["--seq-length", "16", "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64",
                    "--num-attention-heads", "2", "--num-query-groups", "1", "--vocab-size", "64"]
"""A one-layer, 32-wide model on 16 tokens: for the flag tests, where the model's size does not matter."""


def train_flags(*overrides: str, tiny_model: bool = False) -> list[str]:
    """`TRAIN_FLAGS` (with `tiny_model`, on `TINY_MODEL_FLAGS`'s model), then `overrides`: a flag given again takes
    its last value, as argparse does."""
    return [*TRAIN_FLAGS, *(TINY_MODEL_FLAGS if tiny_model else ()), *overrides]


def torchrun_train(nproc, args, tmp_path):
    """`python -m megatron_lc.train ARGS` under torchrun with `nproc` processes in `tmp_path`; its stdout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "megatron_lc.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def logged_losses(log_dir):
    """The losses a run wrote to metrics.jsonl in `log_dir`."""
    return [json.loads(line)["loss"] for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
