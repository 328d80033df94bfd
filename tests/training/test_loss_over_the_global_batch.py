"""The loss of a step is the token-weighted mean over every loss token of the global batch: across
micro-batches, data-parallel ranks and context-parallel shards (not a mean of means), with masked targets
left out (a chat loss mask: spans of prompts, and a sample with no loss token at all). Each layout equals
the single-process fp32 reference on the same tokens, loss (1e-5) and every gradient (1e-4), over two steps."""

from __future__ import annotations

import pytest
import torch

from megatron_lc.models.llama import get_config
from megatron_lc.parallel_state import ParallelDims, ParallelState
from megatron_lc.testing import make_batch
from megatron_lc.training.step import forward_backward
from tests.exactness import BATCH, CPU, check_against_reference, checks_that_ran, reference_run
from tests.helpers import parallelize_options

DEBUG = get_config("debug")  # 8 heads, 2 kv heads
MASKED = dict(BATCH, num_samples=8, masked_spans=True)
"""8 samples: 2 data-parallel ranks x 2 micro-batches of 2 samples; sample 1 holds no loss token."""
STACK = dict(recompute_granularity="full", offload_mode="prefetch", mlp_tiles=3, loss_tiles=5)

CASES = {  # name: (cp, cp_ring, options); every case with dp 2 on 4 ranks, 2 micro-batches per rank
    "ulysses+stack": (2, 1, parallelize_options(**STACK)),
    "untied+kept-attention": (2, 1, parallelize_options(**STACK, cp_impl="untied_ulysses", heads_per_stage=4,
                                                        keep_attention_output=True)),
    "ring+stack": (2, 2, parallelize_options(**STACK)),
}


def _cases(rank, world, names):
    for name in names:
        cp, ring, opts = CASES[name]
        try:
            check_against_reference(rank, world, DEBUG, cp, opts, MASKED, 2, ring, micro_batches=2)
        except Exception as e:
            raise AssertionError(f"case {name}: {e}") from e


def test_masked_loss_over_micro_batches_dp_and_cp_shards_matches_single_process(checked):
    """Ulysses, Untied Ulysses and ring, each with dp 2, two micro-batches per rank, full recompute, offload,
    tiled MLP and loss (and kept attention with Untied); one case after the other in the same 4 processes."""
    assert "dp2" in checked



def _a2a_p2p(rank, world):
    check_against_reference(rank, world, DEBUG, 4, parallelize_options(**STACK), MASKED, 2, 2, micro_batches=4)


def test_masked_loss_under_a2a_p2p_with_micro_batches_matches_single_process(checked):
    """a2a+p2p 2 x 2 (cp 4, no data parallelism), 4 micro-batches of 2 samples."""
    assert "a2a+p2p" in checked


@pytest.fixture(scope="module")
def checked():
    """Both 4-rank checks in one gloo launch: the names of those that ran."""
    return checks_that_ran({4: {"dp2": (_cases, (sorted(CASES),)), "a2a+p2p": (_a2a_p2p, ())}})


def test_the_loss_is_the_mean_over_loss_tokens_not_a_mean_of_micro_batch_means():
    """One process, the batch in micro-batches of unequal loss-token counts: the loss and gradients of one
    micro-batch of everything, and the loss is the sum of token losses over their count."""
    batch, per_sample = make_batch(**MASKED)
    losses, _, grads = reference_run(DEBUG, batch, steps=1)
    from megatron_lc.models.llama import build_model
    from megatron_lc.testing import shard_batch

    model = build_model(DEBUG, device="cpu", seed=0)
    parts = [shard_batch(batch, per_sample, m, 4, 0, 1) for m in range(4)]
    counts = [int((p.labels != -100).sum()) for p in parts]
    assert len(set(counts)) > 1, "micro-batches of unequal loss-token counts"
    result = forward_backward(model, parts, ParallelState(ParallelDims(world_size=1)), CPU.accelerator)
    assert int(result.num_valid_tokens) == sum(counts) == int((batch.labels != -100).sum())
    torch.testing.assert_close(result.loss, losses[0], rtol=1e-6, atol=0)
    with torch.no_grad():
        sums = [model(p.input_ids, p.position_ids, p.labels, p.cu_seqlens)[0] for p in parts]
    torch.testing.assert_close(result.loss, sum(sums) / sum(counts), rtol=1e-6, atol=0)
    mean_of_means = sum(s / max(c, 1) for s, c in zip(sums, counts)) / len(parts)
    assert abs(float(mean_of_means) - float(result.loss)) > 1e-3, "the two would not tell a mean of means apart"
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[0][n], rtol=1e-4, atol=1e-6)


def test_each_step_logs_its_loss_tokens_in_metrics_and_on_the_console(tmp_path, capsys):
    """A masked dataset: metrics.jsonl and the console line give each step's loss tokens, the unmasked targets
    of the step's samples."""
    import json

    import numpy as np

    from megatron_lc.arguments import parse_config
    from megatron_lc.data.sources import build_datasets
    from megatron_lc.training.trainer import train
    from tests.helpers import write_masked_dataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 500, size=n).tolist() for n in rng.integers(5, 50, size=60)]
    masks = [(np.arange(len(d)) >= len(d) // 2).astype(int).tolist() for d in docs]  # the second half trained
    prefix = write_masked_dataset(tmp_path / "chat", docs, masks)
    train(parse_config(["--data-path", prefix, "--split", "100,0,0", "--seq-length", "32", "--train-iters", "2",
                        "--global-batch-size", "2", "--seed", "7", "--device", "cpu",
                        "--log-dir", str(tmp_path / "log")]))
    logged = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    source = build_datasets([prefix], 32, seed=7, split="100,0,0").train
    want = [sum(int((source.get(i).labels != -100).sum()) for i in range(2 * s, 2 * s + 2)) for s in range(2)]
    assert [m["loss_tokens"] for m in logged] == want and all(0 < w < 64 for w in want)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert [f"| {w:,} loss tokens |" in line for line, w in zip(lines, want)] == [True, True]
