"""Apply parallelism and the memory stack to a meta-device LLaMA, in a fixed order.

    model = build_model(config)                      # meta: no rank holds real weights
    offload = parallelize_llama(model, pstate, opts, devices)
    materialize(model, devices, seed)                # real (sharded) weights

Order: attention backend (context parallelism) -> memory stack (recompute, offload,
tiling) -> FSDP2 (blocks, embedding, head, root last). Each step is one short function.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from megatron_lc.attention.context_parallel import ContextParallel
from megatron_lc.attention.kernels import Kernel
from megatron_lc.attention.registry import build_attention_backend
from megatron_lc.devices import Devices
from megatron_lc.flags import flag
from megatron_lc.memory.offload import OffloadScheduler
from megatron_lc.memory.stack import MemoryStack
from megatron_lc.memory.tiling import RankLoop, TileBounds, every_rank, tile_bounds
from megatron_lc.models.llama.model import RMSNorm, RMSNormOp, Transformer, parameter_seed
from megatron_lc.parallel_state import ParallelState


@dataclass(frozen=True)
class FSDPSettings:
    """How FSDP2 shards the model (`fully_shard` of each block, the embedding, the head, then the root)."""

    param_dtype: torch.dtype = torch.float32
    """Compute dtype of parameters (bf16 with --bf16; the master weights stay fp32)."""
    reduce_dtype: torch.dtype = torch.float32
    """Gradient reduce-scatter dtype."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each block's forward (re-gathered in backward)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (--fsdp-cpu-offload)."""


@dataclass
class FSDPArgs:
    """The flags of data-parallel sharding (`TrainConfig.fsdp`): how FSDP2 shards (`settings`), its replicas
    (HSDP's outer dimension of the process mesh), and Megatron-LM's sharded optimizer, which FSDP2 replaces."""

    data_parallel_replicate: int = flag(1, "HSDP replicas (outer data-parallel dimension); the rest is sharded")
    fsdp_cpu_offload: bool = flag(False, "keep sharded parameters, gradients and optimizer state in host memory")
    no_reshard_after_forward: bool = flag(False, "keep gathered parameters between forward and backward")
    use_distributed_optimizer: bool = flag(False, "Megatron-LM's sharded optimizer: refused, as FSDP2 always shards "
                                           "the optimizer state (drop the flag)")

    def settings(self, param_dtype: torch.dtype) -> FSDPSettings:
        """FSDP2's settings, parameters computed in `param_dtype` (the run's compute dtype), gradients reduced
        in fp32."""
        return FSDPSettings(param_dtype=param_dtype, reduce_dtype=torch.float32,
                            reshard_after_forward=not self.no_reshard_after_forward, cpu_offload=self.fsdp_cpu_offload)


@dataclass(frozen=True)
class ParallelizeOptions:
    """How to run the model: its context-parallel attention, its memory stack and its FSDP sharding, each a
    spec owned by its room; and the ops the planner passes in place of the real ones (the kernel table, the tile
    policy, the fp32 sums' GEMM, the norm op), handed to the model here rather than set in another module."""

    cp: ContextParallel = ContextParallel()
    """Context-parallel attention (`attention/context_parallel.py`)."""
    memory: MemoryStack = MemoryStack()
    """The memory stack (recompute, offload, kept attention, tiles): `memory/stack.py`."""
    fsdp: FSDPSettings = FSDPSettings()
    seq_length: int | None = None
    """Tokens per sample: ring attention (a cp layout with a ring) cuts them into chunks."""
    kernels: Mapping[str, Kernel] | None = None
    """The table the attention kernel is looked up in; None: the real kernels (the planner passes its stand-ins)."""
    tile_bounds: TileBounds = tile_bounds
    """The tile policy of every sequence-tile loop (the planner's runs representative tiles)."""
    rank_loop: RankLoop = every_rank
    """The rank policy of Untied Ulysses' per-rank projection loops and of the ring's steps (the planner's runs
    two ranks, and the ring's last step)."""
    fp32_out_gemm: bool | None = None
    """How the tile loops sum 16-bit products in fp32 (`tiling.addmm_fp32_`): True, one GEMM writing fp32 (CUDA);
    False, fp32 copies of operand blocks (CPU); None: whichever the device runs. The planner states its target's."""
    rms_norm: RMSNormOp = F.rms_norm
    """The op of every RMSNorm (the planner passes `planning.gpu_allocations.cuda_rms_norm` when planning for CUDA:
    traced on CPU, `F.rms_norm` decomposes and saves what torch's fused CUDA kernel does not)."""

    def validate(self) -> None:
        self.memory.validate()


def apply_attention_backend(model: Transformer, pstate: ParallelState, opts: ParallelizeOptions,
                            devices: Devices) -> None:
    c, cp = model.config, opts.cp.on(pstate.context_layout)
    model.set_attention_backend(build_attention_backend(
        cp.impl if pstate.cp_size > 1 else "local", c.kv_channels, devices.accelerator, pstate,
        kernel=cp.kernel, heads_per_stage=cp.heads_per_stage, overlap=cp.overlap, untied_backward=cp.untied_backward,
        ring_kv_grads=cp.ring_kv_grads, documents=cp.layout.documents,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_query_groups, seq_length=opts.seq_length,
        kernels=opts.kernels, tile_bounds=opts.tile_bounds, fp32_out_gemm=opts.fp32_out_gemm, rank_loop=opts.rank_loop,
    ))


def apply_norm_op(model: Transformer, opts: ParallelizeOptions) -> None:
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.op = opts.rms_norm


def apply_memory_stack(model: Transformer, opts: ParallelizeOptions, devices: Devices) -> OffloadScheduler | None:
    return opts.memory.apply(model, devices, opts.tile_bounds, opts.fp32_out_gemm)


def apply_fsdp(model: Transformer, pstate: ParallelState, opts: ParallelizeOptions) -> None:
    """fully_shard each block, the embedding and the head (unless tied to it), then the root."""
    fsdp = opts.fsdp
    kwargs = dict(
        mesh=pstate.fsdp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=fsdp.param_dtype, reduce_dtype=fsdp.reduce_dtype),
        offload_policy=CPUOffloadPolicy() if fsdp.cpu_offload else None,
    )
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=fsdp.reshard_after_forward, **kwargs)
    if not model.config.tie_embeddings:  # a shared weight must live in one FSDP unit: the root
        fully_shard(model.embed_tokens, reshard_after_forward=fsdp.reshard_after_forward, **kwargs)
        fully_shard(model.head, reshard_after_forward=False, **kwargs)  # backward starts with it
    fully_shard(model, reshard_after_forward=False, **kwargs)


def parallelize_llama(model: Transformer, pstate: ParallelState, opts: ParallelizeOptions,
                      devices: Devices) -> OffloadScheduler | None:
    """Apply CP -> memory stack -> FSDP to a meta-device model; returns the offload scheduler, if any."""
    opts.validate()
    model.sample_length = opts.seq_length
    apply_attention_backend(model, pstate, opts, devices)
    apply_norm_op(model, opts)
    offload = apply_memory_stack(model, opts, devices)
    if pstate.distributed:
        apply_fsdp(model, pstate, opts)
    return offload


def materialize(model: Transformer, devices: Devices, seed: int = 0, fsdp_cpu_offload: bool = False) -> None:
    """Allocate (sharded) parameters and initialise them: the same weights whatever the layout.

    Each parameter's full initial value is drawn from (seed, its name), one parameter at a
    time, and each rank keeps its own shard, so a run on 8 ranks starts from exactly the
    weights of a run on 1 (and a resumed run on another world size continues the same run).
    """
    model.to_empty(device=torch.device("cpu") if fsdp_cpu_offload else devices.accelerator)
    model.tie_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = model.initial_value(name, param.shape, devices.accelerator, _generator(devices, seed, name))
            _copy_into_shard(param, full)


def _generator(devices: Devices, seed: int, name: str) -> torch.Generator:
    return torch.Generator(device=devices.accelerator).manual_seed(parameter_seed(seed, name))


def _copy_into_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` into a (possibly DTensor) parameter, without communication."""
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)
