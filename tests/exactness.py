"""The exactness harness: the single-process fp32 reference run, and the check that a parallel layout's losses,
gradient norms and full gradients equal it step by step. Every parallel and memory feature's test runs it."""

import dataclasses

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from megatron_lc.devices import Devices
from megatron_lc.models.llama import build_model
from megatron_lc.models.llama.parallelize import materialize, parallelize_llama
from megatron_lc.parallel_state import ParallelDims, ParallelState
from megatron_lc.testing import make_batch, rank_zero_result, shard_batch
from megatron_lc.training.optim import build_optimizer, clip_grad_norm
from megatron_lc.training.step import forward_backward

CPU = Devices(torch.device("cpu"), torch.device("cpu"))
LR = 1e-3
# Adam divides by |grad| + eps: with the default eps, gradients at rounding-noise level
# (1e-9, below the 1e-6 tolerance) would move weights by a sizeable fraction of lr in
# one run and not the other. A larger eps leaves real gradients' updates intact.
ADAM_EPS = 1e-4


def reference_run(config, batch, steps=2):
    """Single process, no parallelism: per-step losses, gradient norms and gradients."""
    model = build_model(config, device="cpu", seed=0)
    opt = build_optimizer(model, lr=LR, eps=ADAM_EPS)
    pstate = ParallelState(ParallelDims(world_size=1))
    losses, norms, grads = [], [], []
    for _ in range(steps):
        result = forward_backward(model, [batch], pstate, CPU.accelerator)
        losses.append(result.loss)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
    return losses, norms, grads


def build_parallel_model(config, pstate, opts, reference_state):
    model = build_model(config, device="meta")
    parallelize_llama(model, pstate, opts, CPU)
    materialize(model, CPU)
    set_model_state_dict(model, reference_state, options=StateDictOptions(full_state_dict=True))
    return model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check_against_reference(rank, world, config, cp, opts, batch_args, steps=2, cp_ring=1, micro_batches=1):
    """Each step's loss (1e-5), gradient norm and every full gradient (1e-4) equal the reference's
    (`cp_ring`: ring degree of the cp group; the rest is all-to-all). The reference takes the global batch
    as one micro-batch; each data-parallel rank takes its samples in `micro_batches` micro-batches.

    Steps after the first check the AdamW update of sharded parameters through their effect
    on the next step's loss and gradients."""
    batch, per_sample = make_batch(**batch_args)
    ref_losses, ref_norms, ref_grads = reference_run(config, batch, steps)
    # The update must move the loss far beyond the tolerance, or step 2 would prove nothing.
    assert abs(ref_losses[1] - ref_losses[0]) > 100 * 1e-5 * abs(ref_losses[0])
    pstate = ParallelState(ParallelDims(world_size=world, cp=cp, cp_ring=cp_ring))
    opts = dataclasses.replace(opts, seq_length=batch_args["seq_length"])
    model = build_parallel_model(config, pstate, opts, build_model(config, device="cpu", seed=0).state_dict())
    opt = build_optimizer(model, lr=LR, eps=ADAM_EPS)
    local = [shard_batch(batch, per_sample, pstate.dp_rank * micro_batches + m, pstate.dp_size * micro_batches,
                         pstate.cp_rank, cp, opts.cp.on(pstate.context_layout).layout) for m in range(micro_batches)]
    for step in range(steps):
        result = forward_backward(model, local, pstate, CPU.accelerator)
        torch.testing.assert_close(result.loss, ref_losses[step], rtol=1e-5, atol=0)
        for n, p in model.named_parameters():
            torch.testing.assert_close(full(p.grad), ref_grads[step][n], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"step {step} {n}: {m}")
        torch.testing.assert_close(clip_grad_norm(model.parameters(), 1.0), ref_norms[step], rtol=1e-5, atol=0)
        opt.step()
        opt.zero_grad()


def run_checks(rank, world, checks: dict) -> list[str]:
    """Each of `checks` (name -> (fn, args): fn(rank, world, *args)) in turn in this group of processes, and the
    names of those that ran: the checks of one file and world size share one launch (starting the processes costs
    more than a check). The first failure fails the launch with its traceback, and so every check after it."""
    for fn, args in checks.values():
        fn(rank, world, *args)
    return list(checks)


def checks_that_ran(checks: dict[int, dict]) -> set[str]:
    """`checks` by world size (world -> name -> (fn, args)), each world's in one launch (`run_checks`): the names of
    those that ran on every rank."""
    return {name for world, named in checks.items() for name in rank_zero_result(run_checks, world, named)}


BATCH = dict(num_samples=2, seq_length=64, vocab=512, seed=1, num_docs=3, ignore_fraction=0.4)
"""Three documents per sample, each its own attention segment (`--reset-attention-mask`)."""
ONE_SEGMENT = dict(BATCH, num_docs=1)
"""Each sample one attention segment across its documents (Megatron's default, without the flag)."""
