"""The autograd function of Untied Ulysses: saves x, the weights, the output and each stage's log-sum-exp, and
runs the staged forward and backward of its backend (`attention/untied_ulysses.py`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from megatron_lc.attention.untied_norm import InputNorm, rms_norm_backward_
from megatron_lc.memory.kept_attention import KeptAttention


@dataclass
class OutputGradient:
    """The gradient of the op's output: of the attention output itself (`wo` None), or of its projection
    by `wo`, whose product with `wo`'s columns gives any stage's attention-output gradient."""

    grad: torch.Tensor  # [B, s, H*d], or [B, s, hidden] with wo
    wo: torch.Tensor | None = None  # [hidden, H*d]


class UntiedUlyssesFunction(torch.autograd.Function):
    """Autograd around the staged forward and backward of `UntiedUlyssesAttention`, and the output
    projection `wo` when given (its input gradient is then made stage by stage, never whole)."""

    @staticmethod
    def forward(ctx, x, wq, wk, wv, wo, norm_weight, cos, sin, cu_seqlens, norm_eps, backend,
                kept: KeptAttention | None):
        norm = None if norm_weight is None else InputNorm.of(x, norm_weight, norm_eps, backend.tile_bounds)
        # lean: the output is kept as its stages' heads, and the backward frees each once sent
        by_stage = wo is not None and backend.output_by_stage
        if kept is not None and kept.replay:  # a recompute: the forward's output and lses, no stage run again
            flat, (outputs, sizes) = kept.take()
            ends = list(itertools.accumulate(sizes))
            out = list(flat[:outputs]) if by_stage else flat[0]
            lses = [tuple(flat[outputs + end - size:outputs + end]) for size, end in zip(sizes, ends)]
        else:
            out, lses = backend.forward_stages(x, wq, wk, wv, cos, sin, cu_seqlens, norm, by_stage=by_stage)
            if kept is not None and kept.keep:  # the output and each stage's lse to the host with the block input
                outs = out if by_stage else [out]
                kept.put((*outs, *itertools.chain.from_iterable(lses)),
                         ((True,) * len(outs) + tuple(i == 0 for stage in lses for i in range(len(stage)))),
                         (len(outs), [len(st) for st in lses]))
        rstd = norm.rstd if norm is not None else None
        # Each stage's (lse, *kernel state), flattened: save_for_backward takes tensors only. The output by stage is
        # held by ctx itself, so that the backward can let each stage's go.
        ctx.save_for_backward(x, wq, wk, wv, wo, norm_weight, rstd, cos, sin, None if by_stage else out,
                              *itertools.chain.from_iterable(lses))
        ctx.stage_outputs, ctx.by_stage = (out if by_stage else None), by_stage
        ctx.stage_sizes = [len(stage) for stage in lses]
        ctx.cu_seqlens, ctx.backend = cu_seqlens, backend
        if by_stage:
            return backend.project_output(out, wo)
        return out if wo is None else torch.nn.functional.linear(out, wo)

    @staticmethod
    def backward(ctx, grad):
        x, wq, wk, wv, wo, norm_weight, rstd, cos, sin, out, *flat = ctx.saved_tensors
        if ctx.by_stage:
            if ctx.stage_outputs is None:
                raise RuntimeError("Untied Ulysses frees its output stage by stage in backward: a second backward "
                                   "through it (retain_graph) is unsupported")
            out, ctx.stage_outputs = ctx.stage_outputs, None
        ends = list(itertools.accumulate(ctx.stage_sizes))
        lses = [tuple(flat[end - size:end]) for size, end in zip(ctx.stage_sizes, ends)]
        needs = ctx.needs_input_grad
        dwo = None
        if wo is not None and needs[4]:  # as nn.Linear's weight gradient: grad^T @ input, one GEMM per stage
            dwo = ctx.backend.output_weight_grad(grad, out, wo)
        output_grad = OutputGradient(grad.contiguous(), wo)
        norm = None if norm_weight is None else InputNorm(norm_weight, rstd)
        dx, dwq, dwk, dwv = ctx.backend.backward_stages(output_grad, x, wq, wk, wv, cos, sin, out, lses,
                                                        ctx.cu_seqlens, (needs[0] or norm is not None, *needs[1:4]),
                                                        norm)
        dnorm = None
        if norm is not None:  # dx holds the gradient of the normed input: through the norm, in place
            dnorm = rms_norm_backward_(dx, x, norm, ctx.backend.tile_bounds)
            dnorm = dnorm.to(norm_weight.dtype) if needs[5] else None
        return dx if needs[0] else None, dwq, dwk, dwv, dwo, dnorm, None, None, None, None, None, None
