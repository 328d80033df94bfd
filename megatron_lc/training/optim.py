"""AdamW on (sharded) parameters and global-norm gradient clipping (the schedule is in schedule.py)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.95),
                    eps: float = 1e-8, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW; fused on CUDA (torch's own kernel), foreach elsewhere (`fused` decides instead: the planner traces
    a CUDA run's fused AdamW on fake tensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.device.type == "cuda" for p in params) if fused is None else fused
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=fused or None, foreach=None if fused else True)


def clip_grad_norm(parameters, max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of all gradients (over every shard), and clipping to max_norm when set."""
    with_grad = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # sums the per-shard partial norms over the mesh
    if max_norm is not None and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach=True)
    return total
