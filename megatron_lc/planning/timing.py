"""Step time: where every second of a training step goes, predicted from the configuration and a machine's rates.

The work of a step is counted from the same shapes the memory planner traces (one document
per sample, as it traces them): per rank and micro-batch, the FLOPs of every GEMM and of
causal attention, forward, recomputed and backward; the bytes of every all-to-all, ring
exchange and FSDP collective, and over which link; the bytes each offloaded block input
moves to the host and back. Each item's time is work over the machine's rate for it
(`Rates`: published figures with their sources, or this machine's, measured once by
`calibrate_local`). With `--packing documents` a sample is its documents (`predict_packed`): each
rank's attention is the pairs inside documents its layout's cut gives it (`context_layout.packed_rank_work`),
its exchanges the tokens it sends, and the slowest rank decides each micro-batch; the documents' lengths
are the run's own or an assumed mix (`packed_work`). Streams overlap as the code runs them:

- compute (GEMMs, attention, the optimizer) is serial on one stream;
- all-to-all exchanges (Ulysses, Untied Ulysses) are synchronous: exposed in full;
- with `--untied-overlap-stages` the inputs of every Untied Ulysses stage but the first travel
  while the stage before it attends (forward, recompute and backward), and in backward a stage's
  gradients travel back while the next one's kernel runs: what exceeds that attention is
  exposed, and so are the first stage's inputs, a forward's last outputs and the backward's last
  gradients;
- ring attention's K/V and dK/dV exchange overlaps the attention on the block in hand:
  what exceeds that attention is exposed; with `--ring-kv-grads in_place` the fp32 dK/dV
  accumulators are rotated after each step's kernels, exposed in full (every ring call's: under
  Untied Ulysses one per stage, with its kv round's heads);
- with `--untied-backward lean` each backward stage sends its dK/dV back with its dQ (a kv
  round's dK/dV travel once per stage instead of once), and o_proj sums the stages' GEMMs in an
  fp32 accumulator (memory-bound: read and written by each, zeroed and read once);
- FSDP's all-gathers and reduce-scatters run on their own streams, prefetched one layer
  ahead: what exceeds the layer's compute is exposed;
- on a CPU (`--machine local`, gloo) nothing overlaps: FSDP2's collectives block the calling thread
  (async_op=False) and gloo copies the ring's and all-to-alls' bytes on the cores the compute needs, so
  every exchange is exposed in full, the embedding's and head's FSDP collectives included;
- an offloaded block input goes to the host on a side stream during the next block's
  forward (what exceeds it is exposed) and comes back exposed: the prefetch is queued
  behind the compute already issued and waited for at once by the layer that needs it;
  with `--offload-prefetch-early` it comes back during the next layer's backward (what
  exceeds that backward is exposed);
- sparse offload (`--offload-every-k-layers k`): only one input per segment of k offloaded
  layers goes to the host, each layer's backward still brings one back (its segment's kept
  one), and a segment of r layers replays r(r-1)/2 block forwards (memory/recompute.py):
  their GEMMs, attention, all-to-alls, ring exchange, memory-bound ops and tile launches are
  priced as a forward's, and the all-gathers of replayed blocks whose backward is not next
  ((r-1)(r-2)/2 per segment) as exposed communication;
- kept attention (`--keep-attention-output`): the recompute of a checkpointed block runs no
  attention forward (its ring exchange neither; under Untied Ulysses no stage at all: no q/k/v
  projection or forward all-to-all either); an offloaded layer's attention output and fp32 lse go to
  the host with its input (what exceeds the next block's forward is exposed) and come back exposed;
  with `--replay-kept-attention` sparse offload's replays of the blocks that keep theirs run no attention
  forward (nor ring exchange; under Untied Ulysses no stage at all) and copy the kept output and lse back
  instead, exposed (the replay waits for it).

Every seconds figure is a prediction. Rates from publications are labelled with their
source; the efficiency factors applied to peak figures are assumptions until a GPU run
measures them (`tests/gpu/run_gpu_checks.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from megatron_lc.attention.untied_plan import StagePlan
from megatron_lc.config import RunSpec, TrainConfig
from megatron_lc.memory.kept_attention import kept_bytes_per_layer
from megatron_lc.context_layout import RankWork, packed_rank_work
from megatron_lc.planning.calibration import CalibrationShapes, calibrate_local
from megatron_lc.planning.packed_work import SAMPLES, DocumentMix, document_mix, total_pairs
from megatron_lc.planning.rates import FA2_BACKWARD_WORK, HOST_ADAM_BYTES_PER_PARAMETER, RATES, Rates

CAUSES = ("attention forward", "attention recompute", "attention backward", "GEMMs", "recompute of the rest",
          "elementwise (memory-bound)", "offload stalls", "exposed communication", "tiling and stage overhead",
          "optimizer")
"""The causes a step's time is split into, in report order."""

GAP_CAUSES = ("recompute", "exposed transfers", "exposed communication", "kernel efficiency",
              "memory-bound ops, launches, optimizer")
"""What separates a predicted step from its floor, in report order: recomputed FLOPs (attention and the rest);
offload copies nothing hides; exchanges nothing hides; causal attention below the kernel's full-tile rate; and the
work the floor leaves out (norms, rotary, residual adds, the loss's softmax, tile and stage launches, the optimizer
step)."""

# --- the work of one step ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Work:
    """One rank's work in one micro-batch, by item (FLOPs or bytes)."""

    gemm_fwd: float
    """Every GEMM of one forward: projections, MLP, output head."""
    gemm_recompute: float
    """GEMMs run again: full / selective recompute, Untied Ulysses' q/k/v re-projection, tiled MLP's gate/up."""
    attention_fwd: float
    attention_recompute: float
    attention_bwd: float
    a2a_bytes: float
    """Bytes sent in synchronous all-to-alls (forward, recompute, backward)."""
    ring_bytes_fwd: float
    """Bytes sent around the ring in the forward passes (the recompute's too; overlapped with attention)."""
    ring_bytes_bwd: float
    fsdp_bytes_per_layer: tuple[float, float]
    """(all-gather per pass, reduce-scatter) bytes per layer."""
    fsdp_gathers_per_layer: int = 2
    """All-gathers of a layer in a step: forward and backward (1 with --no-reshard-after-forward)."""
    fsdp_outer_bytes: tuple[float, float] = (0.0, 0.0)
    """(all-gathers, reduce-scatters) bytes of the embedding and the output head in a step."""
    offload_bytes_per_layer: float
    offloaded_layers: int
    """Layers whose backward brings an input back from the host (one copy back each)."""
    layers: int
    launches: int
    """Tiles, stages and collectives, over all passes."""
    elementwise_bytes: float
    """Bytes read and written by the memory-bound ops (norms, rotary, residual adds, SwiGLU, the exchanges'
    packing, the loss's softmax over the logits), over all passes."""
    optimizer_bytes: float
    host_optimizer_params: float = 0.0
    """Parameters of this rank's shards that the host's AdamW steps (--optimizer-cpu-offload; 0: on the GPU)."""
    model_flops: float
    """fwd + bwd FLOPs without recompute (for MFU): 3 x (GEMMs + attention forward)."""
    kept_inputs: int | None = None
    """Block inputs copied to the host (one per segment under sparse offload); None: `offloaded_layers`."""
    replayed_blocks: float = 0.0
    """Block forwards sparse offload replays in backward (already counted in the recompute items above)."""
    replay_gathers: float = 0.0
    """FSDP all-gathers of replayed blocks beyond those the backward makes anyway (exposed)."""
    kept_attention_bytes_per_layer: float = 0.0
    """--keep-attention-output: the attention output and lse an offloaded layer that keeps them copies to the host
    and back."""
    kept_attention_reads: float = 0.0
    """--replay-kept-attention: replayed blocks that copy their kept attention output and lse back (exposed)."""
    attention_keeping_offloaded: int | None = None
    """Offloaded layers that keep their attention output (the first ones); None: every offloaded layer."""
    attention_keeping_kept_inputs: int | None = None
    """Of those, the ones that also keep their block input (segment heads under sparse offload); None: all kept
    inputs."""
    prefetch_early: bool = False
    """--offload-prefetch-early: offloaded tensors come back during the backward of the layer after theirs."""
    pipelined_a2a: tuple = ()
    """--untied-overlap-stages: the all-to-alls of pipelined stages (PipelinedExchange), not in `a2a_bytes`."""
    ring_bytes_exposed: float = 0.0
    """--ring-kv-grads in_place: the fp32 dK/dV accumulators rotated after each ring step, nothing hiding them."""
    attention_segments: float = 0.0
    """Document segments a layer's attention calls hold in one forward (every stage's, every ring step's): a kernel
    with no variable-length entry point (the CPU's) runs one call each (`Rates.segment_s`)."""


@dataclass(frozen=True)
class PipelinedExchange:
    """The all-to-alls of pipelined Untied Ulysses stages in one kind of pass, over every layer and pass."""

    kind: str
    """fwd (forward, recompute, sparse offload's replays) or bwd: the attention rate that hides them."""
    inputs_bytes: float
    """Bytes of the stages' exchanges that attention can hide (in backward the gradients sent back too); one
    stage's worth is exposed."""
    attention_flops: float
    """The attention of those passes."""
    stages: int
    exposed_bytes: float
    """Bytes nothing hides besides: the forward's last outputs."""

    def exposed_s(self, link: float, attention_rate: float) -> float:
        """Seconds of exchange not hidden behind attention (stages of equal size)."""
        t, a, n = self.inputs_bytes / link, self.attention_flops / attention_rate, self.stages
        return t / n + self.exposed_bytes / link + (n - 1) / n * max(0.0, t - a)


def block_input_bytes_per_gpu(cfg: TrainConfig, spec: RunSpec) -> int:
    """One block input of one rank, `[B*S/cp, hidden]` in the compute dtype (what offload copies per block);
    `spec` is `cfg`'s."""
    tokens = cfg.data.micro_batch_size * cfg.data.seq_length // spec.dims.cp
    return tokens * spec.model.hidden_size * (2 if cfg.train.bf16 else 4)


def kept_attention_bytes_per_gpu(cfg: TrainConfig, spec: RunSpec) -> int:
    """One block's kept attention output and lse on one rank (`--keep-attention-output`); `spec` is `cfg`'s."""
    c = spec.model
    tokens = cfg.data.micro_batch_size * cfg.data.seq_length // spec.dims.cp
    return kept_bytes_per_layer(tokens, c.num_attention_heads, c.kv_channels, 2 if cfg.train.bf16 else 4)


def step_work(cfg: TrainConfig, num_gpus: int, spec: RunSpec | None = None, share: RankWork | None = None) -> Work:
    """The work of one micro-batch on one rank of `cfg` on `num_gpus` GPUs (`spec`: its run spec there, when the
    caller has it). `share`: the rank's tokens, attention pairs and exchanged tokens of a packed micro-batch (its
    samples' documents); None: every sample one document of --seq-length tokens, shared evenly."""
    spec = spec or cfg.run_spec(num_gpus)
    c, stack, cp_spec = spec.model, spec.parallelize.memory, spec.parallelize.cp
    cp, layout = spec.dims.cp, cp_spec.layout
    B, S = cfg.data.micro_batch_size, cfg.data.seq_length
    T, h, f, H, Hkv, d, V, L = B * S // cp, c.hidden_size, c.ffn_hidden_size, c.num_attention_heads, \
        c.num_query_groups, c.kv_channels, c.vocab_size, c.num_layers
    item = 2 if cfg.train.bf16 else 4
    attention = 2 * B * S * S * d * H / cp  # causal: half of QK^T and PV, one document per sample
    ring_tokens = B * S // layout.ring_size  # a ring rank's tokens, whose K and V travel
    Tx = T  # tokens through the all-to-alls
    # One document a sample: the own call's two chunks, and two calls a ring step (R - 1 steps and its own tail over
    # its head); one call without a ring (`packed_rank_work` counts the same, tested)
    segments = B * (1 if layout.ring_size == 1 else 2 * layout.ring_size + 1)
    if share is not None:  # QK^T and PV over the pairs inside documents; only the exchanged tokens travel
        T, attention, Tx, segments = share.tokens, 4 * share.pairs * d * H, share.a2a_tokens, share.segments
        ring_tokens = share.ring_tokens * layout.a2a_size  # the ring rank's rows that travel (a share per a2a rank)
    qkv = 2 * T * h * d * (H + 2 * Hkv)
    mlp = 6 * T * h * f
    layer_gemm = qkv + 2 * T * H * d * h + mlp
    head_gemm = 2 * T * h * V
    full, selective = stack.recompute_granularity == "full", stack.recompute_granularity == "selective"
    untied = cp_spec.untied
    mlp_tiles = stack.mlp_tiles
    R = stack.checkpointed_layers(L)  # blocks checkpointed under full recompute (--recompute-method block: the first N)
    K = stack.kept_attention_layers(L)  # the first K checkpointed blocks keep their attention output and lse
    keep = K > 0
    recompute = R * layer_gemm if full else L * mlp if selective else 0
    recompute -= K * qkv if untied else 0  # Untied Ulysses runs no stage in a kept block's recompute
    recompute += L * qkv if untied else 0  # its backward projects q, k, v again
    recompute += L * 4 * T * h * f if mlp_tiles else 0  # gate and up again, tile by tile
    plan = StagePlan(H, Hkv, layout.a2a_size, cp_spec.stage_heads) if untied else None
    lean = untied and cp_spec.untied_backward == "lean"
    kv_returns = plan.stages_per_round if lean else 1  # dK/dV sent back per round
    a2a = (_a2a_bytes(Tx, H, Hkv, d, item, layout.a2a_size, untied, full and not untied, kv_returns=kv_returns) * K
           + _a2a_bytes(Tx, H, Hkv, d, item, layout.a2a_size, untied, full, kv_returns=kv_returns) * (R - K)
           + _a2a_bytes(Tx, H, Hkv, d, item, layout.a2a_size, untied, False, kv_returns=kv_returns) * (L - R))
    attention_recomputed = R - K if full else 0
    ring_fwd = ring_bwd = ring_exposed = 0.0
    if layout.ring_size > 1:
        # The kv heads a GPU's ring calls of one layer carry: Ulysses' share of them in one call; under Untied
        # Ulysses one call per stage, each with its kv round's heads.
        calls_kv_heads = plan.num_stages * plan.kv_heads_per_round if untied else \
            max(Hkv, layout.a2a_size) // layout.a2a_size
        kv = 2 * ring_tokens * calls_kv_heads * d * item  # K and V of the ring rank's tokens
        ring_fwd = kv * (layout.ring_size - 1)
        accumulators = kv * layout.ring_size * 4 / item  # the fp32 dK/dV, R hops
        ring_bwd = ring_fwd + accumulators  # K/V again, and the accumulators
        if cp_spec.ring_kv_grads == "in_place":  # rotated after each step, waited for
            ring_bwd, ring_exposed = ring_fwd, accumulators * L
    params_layer = h * d * (H + 2 * Hkv) + H * d * h + 3 * h * f + 2 * h
    shards = num_gpus // spec.dims.dp_replicate
    share = (shards - 1) / shards if shards > 1 else 0.0
    fsdp = (params_layer * item * share, params_layer * 4 * share)
    reshard = spec.parallelize.fsdp.reshard_after_forward
    # the embedding gathered for forward and (resharded) again for backward, the head once; each reduced once
    # a tied weight stays with the root, gathered once (the root keeps it through the backward); else the embedding
    # twice when resharded after forward, and the head once
    outer_params = V * h if c.tie_embeddings else (2 if reshard else 1) * V * h + V * h
    outer = (outer_params * item * share, (1 if c.tie_embeddings else 2) * V * h * 4 * share)
    offloaded = stack.offloaded_layers(L)
    sparse = stack.sparse_offload(L)
    kept, replayed, replay_gathers = sparse.kept_inputs, sparse.replayed_forwards, sparse.replay_gathers
    replay_attention = stack.replayed_attention_forwards(L)  # replays that compute attention
    reading = replayed - replay_attention  # replays that read their block's kept attention instead
    loss_tiles = stack.loss_tiles or 0
    stages = (H // cp_spec.stage_heads) if untied else (1 if cp_spec.all_to_all else 0)
    passes = 3 if full else 2
    launches = L * ((mlp_tiles or 0) * passes + stages * passes) - (K * stages if untied else 0) + loss_tiles
    launches += L * 2 * stages if kv_returns > 1 else 0  # a backward stage's dK/dV in two exchanges of their own
    # Sparse offload's replayed forwards: each a block forward (the recompute of a kept-input layer, again); under
    # Untied Ulysses a replay that reads its kept attention runs no stage (no q/k/v projection, no exchange).
    staged = replay_attention if untied else replayed
    recompute += replayed * layer_gemm - (reading * qkv if untied else 0)
    a2a += staged * _a2a_bytes(Tx, H, Hkv, d, item, layout.a2a_size, untied, full, forward_only=True)
    launches += replayed * (mlp_tiles or 0) + staged * stages
    pipelined = ()
    if untied and cp_spec.overlap:
        q, kv, o = _a2a_parts(Tx, H, Hkv, d, item, layout.a2a_size)
        forwards = L + attention_recomputed + staged  # passes that run the stages forward
        pipelined = (PipelinedExchange("fwd", forwards * (q + kv + o), forwards * attention, stages, forwards * o / stages),
                     PipelinedExchange("bwd", L * (2 * q + (1 + kv_returns) * kv + 2 * o),
                                       L * attention * FA2_BACKWARD_WORK, stages, 0.0))
        a2a = 0.0
    segments *= stages if untied else 1  # Untied Ulysses attends stage by stage
    total_params = L * params_layer + 2 * V * h
    host_optimizer = cfg.optim.optimizer_cpu_offload
    # Per layer forward: two norms (read, write), two residual adds (2 reads, 1 write), rotary of q and k,
    # SwiGLU (2 reads, 1 write of [T, f]), the attention inputs and output packed for the exchange; the
    # backward touches about twice that. The loss: fp32 logits written, softmax read and written, its
    # gradient written and read (6 passes over [T, V]).
    layer_bytes = T * item * (10 * h + 2 * (H + Hkv) * d + 3 * f + 2 * (2 * H + 2 * Hkv) * d)

    passes_fwd = 2 if full else 1
    elementwise = (L * (passes_fwd + 2) + replayed) * layer_bytes + 6 * T * V * 4
    if lean:  # o_proj's fp32 accumulator in every forward of the op (a kept block's recompute projects too)
        elementwise += (L + (R if full else 0) + replayed) * T * h * 4 * (2 * stages + 2)
    return Work(
        gemm_fwd=L * layer_gemm + head_gemm, gemm_recompute=recompute, attention_fwd=L * attention,
        attention_recompute=(attention_recomputed + replay_attention) * attention,
        attention_bwd=L * attention * FA2_BACKWARD_WORK, a2a_bytes=a2a,
        ring_bytes_fwd=ring_fwd * (L + attention_recomputed + replay_attention), ring_bytes_bwd=ring_bwd * L,
        fsdp_bytes_per_layer=fsdp, fsdp_gathers_per_layer=2 if reshard else 1, fsdp_outer_bytes=outer,
        offload_bytes_per_layer=T * h * item, offloaded_layers=offloaded, layers=L,
        launches=launches, elementwise_bytes=elementwise,
        optimizer_bytes=0.0 if host_optimizer else 28 * total_params / max(shards, 1),
        host_optimizer_params=total_params / max(shards, 1) if host_optimizer else 0.0,
        model_flops=3 * (L * layer_gemm + head_gemm + L * attention), kept_inputs=kept, replayed_blocks=replayed,
        replay_gathers=replay_gathers, kept_attention_bytes_per_layer=kept_attention_bytes_per_gpu(cfg, spec) if keep else 0.0,
        kept_attention_reads=reading,
        attention_keeping_offloaded=min(K, offloaded),
        attention_keeping_kept_inputs=min(kept, -(-min(K, offloaded) // stack.offload_every_k_layers)),
        prefetch_early=stack.offload_mode == "early" and offloaded > 0, pipelined_a2a=pipelined,
        ring_bytes_exposed=ring_exposed, attention_segments=segments)


def _a2a_parts(T, H, Hkv, d, item, a2a) -> tuple[float, float, float]:
    """Bytes one rank sends of a layer's q, of its k and v, and of its output, in one exchange of each."""
    rep = max(1, a2a // Hkv)  # kv heads replicated when there are fewer than ranks
    off_rank = item * (a2a - 1) / a2a
    return T * H * d * off_rank, T * 2 * Hkv * rep * d * off_rank, T * H * d * off_rank


def _a2a_bytes(T, H, Hkv, d, item, a2a, untied, full, forward_only: bool = False, kv_returns: int = 1) -> float:
    """Bytes one rank sends in a layer's all-to-alls (Ulysses or Untied Ulysses), all passes (or one forward);
    `kv_returns`: how many times a kv round's dK/dV go back (once, or once per stage with --untied-backward lean)."""
    if a2a <= 1:
        return 0.0
    q, kv, o = _a2a_parts(T, H, Hkv, d, item, a2a)
    forward = q + kv + o
    if forward_only:
        return forward
    backward = (q + kv + o + o + q + kv * kv_returns) if untied else (o + q + kv)  # Untied re-sends q, k, v and o
    return forward * (2 if full else 1) + backward


# --- time -----------------------------------------------------------------------------------


@dataclass
class StepTime:
    """Predicted seconds of one step by cause, and what follows from them."""

    seconds: dict
    tokens: int
    """Tokens of the global batch."""
    model_flops_per_gpu: float
    peak_flops: float
    rates: str
    attention_kernel: str
    floor_s: float = 0.0
    """The step's floor: every FLOP of the model once (GEMMs forward and backward, attention forward and backward)
    at the machine's kernel rates, attention at the kernel's full-tile (non-causal) rate; nothing recomputed,
    exposed or memory-bound."""
    gap_s: dict = field(default_factory=dict)
    """What separates the step from the floor, by cause (`GAP_CAUSES`, and `IMBALANCE` for packed data):
    floor_s + sum(gap_s) = step_s."""
    packed: dict | None = None
    """--packing documents: where the documents' lengths came from, the attention call length their rates are
    taken at, their pairs' share of a full causal square, the slowest rank's pairs over the mean rank's (median,
    p90 and worst micro-batch)."""

    @property
    def step_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops_per_gpu / (self.step_s * self.peak_flops)

    def to_json(self) -> dict:
        return {"step_s": round(self.step_s, 6), "tokens_per_s": round(self.tokens_per_s, 3),
                "mfu": round(self.mfu, 4), "rates": self.rates, "attention_kernel": self.attention_kernel,
                "by_cause_s": {k: round(v, 6) for k, v in self.seconds.items()}, "floor_s": round(self.floor_s, 6),
                "over_floor": round(self.step_s / self.floor_s, 4) if self.floor_s else None,
                "gap_to_floor_s": {k: round(v, 6) for k, v in self.gap_s.items()}} | (
                    {"packed": self.packed} if self.packed is not None else {})


def attention_family(cfg: TrainConfig, flash_attn: bool, flash_impl: str = "default") -> str:
    """The rate family of the kernel `--attention-kernel` runs on the GPUs: fa2, fa3 (FA3, and FA4 at FA3's
    rates, an assumption: no Hopper figures of FA4's are published that we know of) or efficient."""
    import torch

    from megatron_lc.attention.kernel_selection import resolve_kernel_name

    dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32
    name = resolve_kernel_name("cuda", cfg.parallel.attention_kernel, dtype, flash_attn, flash_impl)
    if name == "sdpa_efficient":
        return "efficient"
    return "fa3" if name == "sdpa_flash" and flash_impl != "default" else "fa2"


def predict(cfg: TrainConfig, num_gpus: int, rates: Rates, gpus_per_node: int = 8, family: str = "fa2"
            ) -> StepTime:
    """The step time of `cfg` on `num_gpus` GPUs at `rates`, by cause; with `--packing documents` counted from the
    documents of the samples the run draws (`packed_work.document_mix`)."""
    spec = cfg.run_spec(num_gpus)
    mix = document_mix(cfg, max(SAMPLES, 4 * _replicas(spec, num_gpus) * cfg.data.micro_batch_size))
    if mix is not None:
        return predict_packed(cfg, num_gpus, spec, mix, rates, gpus_per_node, family)
    return _predict(cfg, num_gpus, spec, step_work(cfg, num_gpus, spec), rates, gpus_per_node, family,
                    cfg.data.seq_length)  # one document per sample


def _replicas(spec: RunSpec, num_gpus: int) -> int:
    """Context-parallel groups of the run: micro-batches trained side by side."""
    return max(1, num_gpus // spec.dims.cp)


def _predict(cfg: TrainConfig, num_gpus: int, spec: RunSpec, w: Work, rates: Rates, gpus_per_node: int, family: str,
             call_tokens: int) -> StepTime:
    """The step time of one rank doing `w` in each micro-batch, attention at the rates of calls of `call_tokens`."""
    cp = spec.dims.cp
    dp = _replicas(spec, num_gpus)
    mbs = cfg.data.micro_batch_size
    micro = max(1, (cfg.data.global_batch_size or mbs * dp) // (mbs * dp))
    layout = spec.parallelize.cp.layout
    fwd_rate, bwd_rate = rates.attention_rates(family, call_tokens)
    gemm = w.gemm_fwd * 3 / rates.gemm_flops
    a_fwd, a_re, a_bwd = w.attention_fwd / fwd_rate, w.attention_recompute / fwd_rate, w.attention_bwd / bwd_rate
    segment_fwd, segment_bwd = rates.segment_s.get(family, (0.0, 0.0))
    if w.attention_segments and (segment_fwd or segment_bwd):  # one kernel call per document segment
        per_layer = w.attention_segments * segment_fwd
        a_fwd += w.layers * per_layer
        a_re += w.layers * per_layer * (w.attention_recompute / w.attention_fwd if w.attention_fwd else 0.0)
        a_bwd += w.layers * w.attention_segments * segment_bwd
    a2a_link = rates.intra_node_bytes if layout.a2a_size <= gpus_per_node else rates.inter_node_bytes
    ring_link = rates.intra_node_bytes if cp <= gpus_per_node else rates.inter_node_bytes
    fsdp_link = rates.intra_node_bytes if num_gpus <= gpus_per_node else rates.inter_node_bytes
    gather, scatter = w.fsdp_bytes_per_layer
    fsdp = (w.fsdp_gathers_per_layer * gather + scatter) / fsdp_link
    exposed = w.a2a_bytes / a2a_link + w.ring_bytes_exposed / ring_link + w.replay_gathers * gather / fsdp_link
    if rates.collectives_overlap:
        exposed += sum(p.exposed_s(a2a_link, fwd_rate if p.kind == "fwd" else bwd_rate) for p in w.pipelined_a2a)
        exposed += (max(0.0, w.ring_bytes_fwd / ring_link - a_fwd - a_re)
                    + max(0.0, w.ring_bytes_bwd / ring_link - a_bwd))
        layer_compute = (gemm + a_fwd + a_re + a_bwd) / max(w.layers, 1)
        exposed += w.layers * max(0.0, fsdp - layer_compute)  # the embedding's and head's: hidden, or negligible
    else:  # every exchange on the compute's own cores, FSDP's to the end before the compute goes on
        exposed += sum(p.inputs_bytes + p.exposed_bytes for p in w.pipelined_a2a) / a2a_link
        exposed += (w.ring_bytes_fwd + w.ring_bytes_bwd) / ring_link
        exposed += w.layers * fsdp + sum(w.fsdp_outer_bytes) / fsdp_link
    block_fwd = (w.gemm_fwd / rates.gemm_flops + a_fwd) / max(w.layers, 1)
    copy = w.offload_bytes_per_layer / rates.host_copy_bytes
    att = w.kept_attention_bytes_per_layer / rates.host_copy_bytes  # an offloaded layer's kept attention
    kept = w.offloaded_layers if w.kept_inputs is None else w.kept_inputs
    keeping = w.offloaded_layers if w.attention_keeping_offloaded is None else w.attention_keeping_offloaded
    both = kept if w.attention_keeping_kept_inputs is None else w.attention_keeping_kept_inputs
    block_bwd = ((2 * w.gemm_fwd + w.gemm_recompute) / rates.gemm_flops + a_re + a_bwd) / max(w.layers, 1)

    def back(seconds: float) -> float:  # one offloaded layer's copy back
        return max(0.0, seconds - block_bwd) if w.prefetch_early else seconds

    to_host = (both * max(0.0, copy + att - block_fwd) + (kept - both) * max(0.0, copy - block_fwd)
               + (keeping - both) * max(0.0, att - block_fwd))
    stalls = to_host + keeping * back(copy + att) + (w.offloaded_layers - keeping) * back(copy)
    stalls += w.kept_attention_reads * att
    seconds = dict.fromkeys(CAUSES, 0.0)
    seconds.update({"attention forward": a_fwd, "attention recompute": a_re, "attention backward": a_bwd,
                    "GEMMs": gemm, "recompute of the rest": w.gemm_recompute / rates.gemm_flops,
                    "elementwise (memory-bound)": w.elementwise_bytes / rates.hbm_bytes,
                    "offload stalls": stalls, "exposed communication": exposed,
                    "tiling and stage overhead": w.launches * rates.launch_s})
    seconds = {k: v * micro for k, v in seconds.items()}
    seconds["optimizer"] = w.optimizer_bytes / rates.hbm_bytes
    if w.host_optimizer_params:  # the host's step, each micro-batch's gradients down and the new weights up, and
        # each later micro-batch's add into the host's gradient (12 B a parameter read and written, at the host
        # memory rate the step's own traffic runs at) on a thread of its own while the backward runs: exposed
        # where the adds outlast the backward, and the last block's adds after it
        adds = w.host_optimizer_params * 12 / HOST_ADAM_BYTES_PER_PARAMETER / rates.host_adam_params
        exposed_adds = max(adds - block_bwd * w.layers, adds / max(w.layers, 1))
        seconds["optimizer"] += w.host_optimizer_params * (1 / rates.host_adam_params
                                                           + 4 * (micro + 1) / rates.host_copy_bytes)
        seconds["optimizer"] += (micro - 1) * exposed_adds
    tokens = micro * mbs * dp * cfg.data.seq_length
    full_fwd = w.attention_fwd / rates.attention_fwd_flops[family]
    full_bwd = w.attention_bwd / rates.attention_bwd_flops[family]
    floor = micro * (gemm + full_fwd + full_bwd)
    gap = {"recompute": seconds["attention recompute"] + seconds["recompute of the rest"],
           "exposed transfers": seconds["offload stalls"], "exposed communication": seconds["exposed communication"],
           "kernel efficiency": micro * (a_fwd - full_fwd + a_bwd - full_bwd),
           "memory-bound ops, launches, optimizer": seconds["elementwise (memory-bound)"]
           + seconds["tiling and stage overhead"] + seconds["optimizer"]}
    return StepTime(seconds, tokens, micro * w.model_flops, rates.peak_flops, rates.name, family, floor, gap)


IMBALANCE = "slowest rank over the mean"
"""Packed data: what the slowest rank's floor exceeds the mean rank's by (a cause of the gap to the floor)."""


def predict_packed(cfg: TrainConfig, num_gpus: int, spec: RunSpec, mix: DocumentMix, rates: Rates,
                    gpus_per_node: int, family: str) -> StepTime:
    """The mean step over the mix's micro-batches: each decided by its slowest rank (of the context-parallel group,
    and of the replicas training beside it), the floor by the mean rank's work: each pair inside a document once."""
    layout = spec.parallelize.cp.layout
    per_segment = any(rates.segment_s.get(family, (0.0, 0.0)))  # segments cost time: a rank's count can decide
    shares = _packed_shares(layout, mix, cfg.data.seq_length, cfg.data.micro_batch_size, _replicas(spec, num_gpus),
                            _FIELDS if per_segment else _FIELDS[:-1])
    call_tokens = mix.call_tokens

    def time_of(work: RankWork) -> StepTime:
        return _predict(cfg, num_gpus, spec, step_work(cfg, num_gpus, spec, work), rates, gpus_per_node, family,
                        call_tokens)

    # A rank's time grows with its tokens, pairs and exchanged tokens: only the ranks no other exceeds in all of
    # them can be a step's slowest. The step is the time of the steps' slowest ranks' mean work: the model is
    # linear in a rank's work except where an exchange surfaces from behind attention in some micro-batches and
    # not in others (the mean of each micro-batch's own step agrees to 1e-5 on Llama3-8B at 1M on 8 GPUs, ring
    # and Untied Ulysses), and one prediction a stack keeps auto-fit's tens of thousands of stacks fast.
    step = time_of(shares.slowest_mean or _mean([max(group.candidates, key=lambda r: time_of(r).step_s)
                                                  for group in shares.steps]))
    even = time_of(shares.mean)  # every pair once, shared evenly: the floor (linear in the work: the mean's)
    gap = dict(step.gap_s)
    gap[IMBALANCE] = step.floor_s - even.floor_s
    packed = {"document_lengths": mix.source, "samples": len(mix.samples), "call_tokens": call_tokens,
              "document_layout": layout.documents, "ring": layout.ring_size, **shares.statistics}
    return StepTime(step.seconds, even.tokens, even.model_flops_per_gpu, even.peak_flops, even.rates,
                    even.attention_kernel, even.floor_s, gap, packed)


@dataclass(frozen=True)
class _StepShares:
    """The ranks of one step's micro-batches side by side (one per replica) that may be its slowest."""

    candidates: tuple[RankWork, ...]
    imbalance: float
    """The slowest rank's pairs over the mean rank's."""


@dataclass(frozen=True)
class _PackedShares:
    steps: tuple[_StepShares, ...]
    mean: RankWork
    """The mean rank of every step."""
    slowest_mean: RankWork | None
    """The mean of the steps' slowest ranks when each step has one candidate (else priced per step)."""
    statistics: dict
    """The samples' pairs inside documents over a full causal square's (mean), and the imbalance's median, p90
    and worst."""


_FIELDS = ("tokens", "pairs", "a2a_tokens", "ring_tokens", "segments")


def _sum(ranks: list[RankWork]) -> RankWork:
    return RankWork(*(sum(getattr(r, f) for r in ranks) for f in _FIELDS))


def _mean(ranks: list[RankWork]) -> RankWork:
    return RankWork(*(sum(getattr(r, f) for r in ranks) / len(ranks) for f in _FIELDS))


@functools.lru_cache(maxsize=64)
def _packed_shares(layout, mix: DocumentMix, seq_length: int, micro_batch: int, replicas: int,
                   priced: tuple[str, ...] = _FIELDS) -> _PackedShares:
    """Each rank's work in each micro-batch (its samples summed) under the layout's cut, grouped by step."""
    per_sample = [packed_rank_work(layout, cu, seq_length) for cu in mix.samples]
    micro = [[_sum([s[r] for s in per_sample[k:k + micro_batch]]) for r in range(layout.cp_size)]
             for k in range(0, len(per_sample) - micro_batch + 1, micro_batch)]
    steps, everyone = [], []
    for k in range(0, len(micro) - replicas + 1, replicas):
        ranks = [r for group in micro[k:k + replicas] for r in group]
        everyone += ranks
        keys = {tuple(getattr(r, f) for f in priced): r for r in ranks}  # what the step is priced by
        candidates = tuple(r for key, r in keys.items()
                           if not any(o != key and all(a >= b for a, b in zip(o, key)) for o in keys))
        mean_pairs = sum(r.pairs for r in ranks) / len(ranks)
        steps.append(_StepShares(candidates, max(r.pairs for r in ranks) / mean_pairs if mean_pairs else 1.0))
    single = all(len(step.candidates) == 1 for step in steps)
    imbalance = [step.imbalance for step in steps]
    statistics = {"pairs_over_full_causal": float(np.mean([total_pairs(cu) for cu in mix.samples]))
                  / (seq_length * (seq_length + 1) / 2), "imbalance_median": float(np.median(imbalance)),
                  "imbalance_p90": float(np.percentile(imbalance, 90)), "imbalance_max": float(max(imbalance))}
    return _PackedShares(tuple(steps), _mean(everyone), _mean([s.candidates[0] for s in steps]) if single else None,
                         statistics)


@dataclass(frozen=True)
class TimeModel:
    """The rates a step is predicted at, and how attention runs on that machine."""

    rates: Rates = RATES["dgx-h100"]
    gpus_per_node: int = 8
    family: str = "fa2"
    """Attention's rate family: fa2 (flash-attn 2 and torch's flash kernel), fa3, efficient or cpu."""

    def predict(self, cfg: TrainConfig, num_gpus: int) -> StepTime:
        return predict(cfg, num_gpus, self.rates, self.gpus_per_node, self.family)

    @staticmethod
    def for_machine(machine, cfg: TrainConfig) -> "TimeModel":
        """The model of `machine` (a planning.estimate.Machine): its node's published rates, or for `local`
        this machine's measured ones shared by `num_gpus` processes."""
        if machine.node == "local":
            shapes = CalibrationShapes.of(cfg, cfg.run_spec(machine.num_gpus))
            mix = document_mix(cfg)
            if mix is not None:  # attention measured at the documents' length, not the sample's
                shapes = dataclasses.replace(shapes, attention_tokens=min(shapes.attention_tokens, mix.call_tokens))
            return TimeModel(calibrate_local(processes=machine.num_gpus, shapes=shapes), machine.gpus_per_node, "cpu")
        impl = machine.flash_impl(cfg.parallel.flash_attention_impl, cfg.attention_call())
        family = attention_family(cfg, machine.flash_attn, impl)  # the node's GPUs, whatever was traced
        return TimeModel(RATES[machine.node], machine.gpus_per_node, family)


def layer_costs(cfg: TrainConfig, num_gpus: int, rates: Rates, gpus_per_node: int = 8, family: str = "fa2"
                ) -> list[tuple[str, float]]:
    """The time each memory layer of `cfg` costs: its step against the same step without it (seconds)."""
    base = predict(cfg, num_gpus, rates, gpus_per_node, family).step_s
    mem, par = cfg.memory, cfg.parallel
    spec = cfg.run_spec(num_gpus)
    stack = spec.parallelize.memory
    without = []
    if stack.replay_kept_attention:
        without.append(("replays reading kept attention (against computing it)", dataclasses.replace(
            cfg, memory=dataclasses.replace(mem, replay_kept_attention=False))))
    if stack.offloads and stack.offload_every_k_layers > 1:
        without.append((f"sparse offload (k={stack.offload_every_k_layers}, against k=1)", dataclasses.replace(
            cfg, memory=dataclasses.replace(mem, offload_every_k_layers=1, replay_kept_attention=False))))
    if stack.keep_attention_output:
        without.append(("kept attention output (against recomputing it)", dataclasses.replace(
            cfg, memory=dataclasses.replace(mem, keep_attention_output=False, replay_kept_attention=False))))
    if stack.offload_mode == "early":
        without.append(("early prefetch (against prefetch at the end of a backward)", dataclasses.replace(
            cfg, memory=dataclasses.replace(mem, offload_mode="prefetch"))))
    if stack.offloads:
        without.append(("offload", dataclasses.replace(cfg, memory=dataclasses.replace(
            mem, offload_mode="none", offload_every_k_layers=1, offload_keep_last=None, replay_kept_attention=False))))
    if stack.recompute_granularity != "none":
        m = dataclasses.replace(mem, recompute_granularity="none", offload_mode="none", offload_every_k_layers=1,
                                offload_keep_last=None, keep_attention_output=False, replay_kept_attention=False,
                                recompute_method=None,
                                recompute_num_layers=None)
        without.append((f"{stack.recompute_granularity} recompute (and offload)", dataclasses.replace(cfg, memory=m)))
    if mem.tiled_mlp:
        without.append(("tiled MLP", dataclasses.replace(cfg, memory=dataclasses.replace(mem, tiled_mlp=False))))
    if mem.tiled_loss:
        without.append(("tiled loss", dataclasses.replace(cfg, memory=dataclasses.replace(mem, tiled_loss=False))))
    if par.untied_backward != "fast":
        without.append(("lean Untied backward (against fast)",
                        dataclasses.replace(cfg, parallel=dataclasses.replace(par, untied_backward="fast"))))
    if par.ring_kv_grads != "overlapped":
        without.append(("ring accumulators in place (against overlapped)",
                        dataclasses.replace(cfg, parallel=dataclasses.replace(par, ring_kv_grads="overlapped"))))
    if par.untied_overlap_stages:
        without.append(("pipelined Untied stages (against synchronous)",
                        dataclasses.replace(cfg, parallel=dataclasses.replace(par, untied_overlap_stages=False))))
    if spec.parallelize.cp.untied:
        without.append(("Untied Ulysses (against Ulysses)", dataclasses.replace(
            cfg, parallel=dataclasses.replace(par, cp_impl="ulysses", untied_overlap_stages=False,
                                              untied_heads_per_stage=None, untied_backward="fast"))))
    return [(name, base - predict(other, num_gpus, rates, gpus_per_node, family).step_s) for name, other in without]

