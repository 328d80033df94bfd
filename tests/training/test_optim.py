import math

import torch

from megatron_lc.training.optim import clip_grad_norm


def _params_with_grads(*grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def test_clip_grad_norm_returns_the_global_norm_and_scales_gradients_to_max_norm():
    params = _params_with_grads(torch.tensor([3.0, 0.0]), torch.tensor([4.0]))
    total = clip_grad_norm(params, 1.0)
    assert math.isclose(total.item(), 5.0, rel_tol=1e-6)
    clipped = torch.cat([p.grad for p in params])
    assert math.isclose(clipped.norm().item(), 1.0, rel_tol=1e-5)


def test_clip_grad_norm_leaves_small_gradients_and_skips_missing_ones():
    params = _params_with_grads(torch.tensor([0.3, 0.4]))
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient
    assert math.isclose(clip_grad_norm(params, 1.0).item(), 0.5, rel_tol=1e-6)
    assert torch.allclose(params[0].grad, torch.tensor([0.3, 0.4]))
