"""What the planner hands the model in place of the real ops travels in `ParallelizeOptions`, reaches every module
that runs it, and changes nothing else in the process."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lc.devices import Devices
from megatron_lc.memory import tiling
from megatron_lc.models.llama import build_model
from megatron_lc.models.llama.model import RMSNorm
from megatron_lc.models.llama.parallelize import materialize, parallelize_llama
from megatron_lc.models.llama.zoo import FLAVOURS
from megatron_lc.parallel_state import ParallelDims, ParallelState
from megatron_lc.testing import make_batch
from megatron_lc.training.step import forward_backward
from tests.helpers import parallelize_options

CPU = Devices(torch.device("cpu"), torch.device("cpu"))
CONFIG = FLAVOURS["debug"]


def _model(**fields):
    model = build_model(CONFIG, device="meta")
    parallelize_llama(model, ParallelState(ParallelDims(world_size=1)), parallelize_options(**fields), CPU)
    materialize(model, CPU)
    return model


def test_the_norm_op_of_the_options_runs_in_every_norm_and_torch_keeps_its_own():
    calls = []

    def recording_rms_norm(x, shape, weight=None, eps=None):
        calls.append(tuple(x.shape))
        return F.rms_norm(x, shape, weight, eps)

    torch_rms_norm = F.rms_norm
    model = _model(rms_norm=recording_rms_norm, mlp_tiles=2, loss_tiles=2)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * CONFIG.num_layers + 1 and all(m.op is recording_rms_norm for m in norms)
    batch, _ = make_batch(1, 16, CONFIG.vocab_size)
    forward_backward(model, [batch], ParallelState(ParallelDims(world_size=1)), CPU.accelerator)
    assert len(calls) == len(norms)
    assert F.rms_norm is torch_rms_norm and _model().layers[0].input_layernorm.op is torch_rms_norm


def test_the_fp32_gemm_path_of_the_options_reaches_the_tiled_mlp_and_loss():
    model = _model(mlp_tiles=2, loss_tiles=2, fp32_out_gemm=False)
    assert all(layer.mlp.fp32_out_gemm is False for layer in model.layers) and model.head.fp32_out_gemm is False
    assert _model(mlp_tiles=2).head.fp32_out_gemm is None  # the device's own path, by default


def test_addmm_fp32_takes_the_path_it_is_told_and_sums_the_same(monkeypatch):
    """False: fp32 copies of the operands, never the fp32-output GEMM; either way the exact fp32 sum."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(8, 8, generator=g).bfloat16() for _ in range(2))
    expected = a.float() @ b.float()
    tried = []
    real_addmm = torch.addmm

    def recording_addmm(*args, **kwargs):
        tried.append(kwargs.get("out_dtype"))
        return real_addmm(*args, **kwargs)

    monkeypatch.setattr(tiling.torch, "addmm", recording_addmm)
    acc = torch.zeros(8, 8)
    tiling.addmm_fp32_(acc, a, b, fp32_out_gemm=False)
    assert tried == [] and torch.equal(acc, expected)
    acc = torch.zeros(8, 8)
    tiling.addmm_fp32_(acc, a, b, fp32_out_gemm=True)  # tried, whatever this device answered before
    assert tried == [torch.float32] and torch.allclose(acc, expected, rtol=1e-6, atol=1e-6)
