"""The memory stack, defined once: its flags, its rules, how it applies to a model, and the counts
the planner and the time model read.

    args = MemoryArgs(recompute_granularity="full", offload_mode="prefetch", tiled_mlp=True)
    args.check(num_layers)                                  # flag rules, one line each
    stack = args.stack(num_layers, chunk_plan)              # typed, tiles resolved
    offload = stack.apply(model, devices)                   # per-block modes, the offload scheduler

`MemoryStack` is what the run does; `MemoryArgs` is how a user says it (Megatron-LM's flag
names; the old offload spellings `--offload-activations`, `--no-offload-prefetch` and
`--offload-prefetch-early` are hidden aliases of `--offload-mode`, folded by `fold_offload_aliases`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from megatron_lc.errors import ConfigError
from megatron_lc.flags import flag
from megatron_lc.memory.chunks import ChunkPlan
from megatron_lc.memory.kept_attention import ATTENTION_KIND, KeptAttention, arena_slots
from megatron_lc.memory.offload import ArenaKey, OffloadScheduler
from megatron_lc.memory.tiling import TileBounds, tile_bounds

RecomputeGranularity = Literal["none", "selective", "full"]
OffloadMode = Literal["none", "on_demand", "prefetch", "early"]
"""none; on_demand: a block input comes back when its own backward needs it; prefetch: during the layer
above's backward, after its peak; early: when the layer above's backward starts (one input more resident)."""
RECOMPUTE_GRANULARITIES: tuple[str, ...] = get_args(RecomputeGranularity)
OFFLOAD_MODES: tuple[str, ...] = get_args(OffloadMode)

OFFLOAD_ALIASES = ("offload_activations", "no_offload_prefetch", "offload_prefetch_early")
"""Old spellings of --offload-mode (still accepted, hidden from --help)."""


@dataclass(frozen=True)
class SparseOffloadCounts:
    """What sparse offload does to `offloaded` layers in segments of k."""

    kept_inputs: int
    """Block inputs kept on the host: one per segment."""
    replayed_forwards: int
    """Block forwards run again in backward to rebuild the inputs not kept."""
    replay_gathers: int
    """FSDP all-gathers those replays add (a replayed layer's parameters gathered outside its own pass)."""


@dataclass(frozen=True)
class MemoryStack:
    """What the memory stack of a run does, resolved (tile counts decided, block method applied)."""

    recompute_granularity: RecomputeGranularity = "none"
    """none | selective (keep attention, recompute the MLP half) | full (keep block inputs only)."""
    recompute_layers: int | None = None
    """Full recompute: only the first this many blocks are checkpointed (--recompute-method block); None: all."""
    offload_mode: OffloadMode = "none"
    """Where checkpointed block inputs live between forward and backward, and when they come back."""
    offload_keep_last: int = 1
    """The last checkpointed blocks whose inputs stay on the accelerator (needed first in backward)."""
    offload_every_k_layers: int = 1
    """Sparse offload: only every k-th offloaded block keeps its input; the others are replayed from it."""
    keep_attention_output: bool = False
    """Full recompute: each checkpointed block keeps its attention output and lse; the recompute runs no
    attention forward."""
    keep_attention_layers: int | None = None
    """With keep_attention_output: only the first this many checkpointed blocks keep theirs (None: all)."""
    replay_kept_attention: bool = False
    """Sparse offload with keep_attention_output: the blocks a segment replays to rebuild its inputs take their
    kept attention output and lse instead of running the attention forward."""
    mlp_tiles: int | None = None
    """Sequence tiles of the MLP; None: untiled."""
    loss_tiles: int | None = None
    """Row tiles of the fused output projection + cross-entropy; None: untiled."""

    @property
    def offloads(self) -> bool:
        return self.offload_mode != "none"

    def validate(self) -> None:
        """The stack's own rules (ConfigError naming the flag)."""
        full = self.recompute_granularity == "full"
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ConfigError(f"--recompute-granularity {self.recompute_granularity!r}: expected none, full or selective")
        if self.offload_mode not in OFFLOAD_MODES:
            raise ConfigError(f"--offload-mode {self.offload_mode!r}: expected one of {', '.join(OFFLOAD_MODES)}")
        if self.offloads and not full:
            raise ConfigError(f"--offload-mode {self.offload_mode} offloads the checkpointed block inputs: it needs "
                              "--recompute-granularity full")
        if self.recompute_layers is not None and (not full or self.recompute_layers < 0):
            raise ConfigError(f"--recompute-num-layers {self.recompute_layers}: a block count >= 0 of "
                              "--recompute-granularity full")
        if self.offload_keep_last < 0:
            raise ConfigError(f"--offload-keep-last {self.offload_keep_last} must be >= 0")
        if self.offload_every_k_layers < 1:
            raise ConfigError(f"--offload-every-k-layers {self.offload_every_k_layers}: expected an integer >= 1")
        if self.offload_every_k_layers > 1 and not self.offloads:
            raise ConfigError("--offload-every-k-layers keeps every k-th offloaded block input: it needs "
                              "--offload-mode (prefetch, early or on_demand)")
        if self.keep_attention_output and not full:
            raise ConfigError("--keep-attention-output keeps what full recompute would run again: it needs "
                              "--recompute-granularity full")
        if self.keep_attention_layers is not None and (not self.keep_attention_output or self.keep_attention_layers < 1):
            raise ConfigError(f"--keep-attention-output-layers {self.keep_attention_layers}: a block count >= 1 of "
                              "--keep-attention-output")
        if self.replay_kept_attention and not (self.keep_attention_output and self.offloads
                                               and self.offload_every_k_layers > 1):
            raise ConfigError("--replay-kept-attention rebuilds sparse offload's block inputs from the kept attention "
                              "outputs: it needs --keep-attention-output and --offload-every-k-layers > 1 with "
                              "--offload-mode")
        for name, tiles in (("--tiled-mlp-tiles", self.mlp_tiles), ("--tiled-loss-tiles", self.loss_tiles)):
            if tiles is not None and tiles < 1:
                raise ConfigError(f"{name} {tiles} must be >= 1")

    # --- the counts the planner and the time model read ------------------------------------

    def checkpointed_layers(self, num_layers: int) -> int:
        """Blocks checkpointed under full recompute (the first --recompute-num-layers with --recompute-method
        block, else all of them); 0 without full recompute."""
        if self.recompute_granularity != "full":
            return 0
        return num_layers if self.recompute_layers is None else min(self.recompute_layers, num_layers)

    def block_recompute(self, layer: int, num_layers: int) -> RecomputeGranularity:
        """What block `layer` recomputes in backward."""
        if self.recompute_granularity != "full":
            return self.recompute_granularity
        return "full" if layer < self.checkpointed_layers(num_layers) else "none"

    def kept_attention_layers(self, num_layers: int) -> int:
        """Checkpointed blocks that keep their attention output (the first --keep-attention-output-layers of them,
        else all); 0 without --keep-attention-output."""
        if not (self.keep_attention_output and self.recompute_granularity == "full"):
            return 0
        checkpointed = self.checkpointed_layers(num_layers)
        return checkpointed if self.keep_attention_layers is None else min(self.keep_attention_layers, checkpointed)

    def offloaded_layers(self, num_layers: int) -> int:
        """Checkpointed blocks whose inputs go to the host: all but the last --offload-keep-last of them."""
        return max(0, self.checkpointed_layers(num_layers) - self.offload_keep_last) if self.offloads else 0

    def sparse_offload(self, num_layers: int) -> SparseOffloadCounts:
        """Kept inputs, replayed forwards and extra all-gathers of the offloaded layers in segments of k."""
        return sparse_offload_counts(self.offloaded_layers(num_layers), self.offload_every_k_layers)

    def replayed_attention_forwards(self, num_layers: int) -> int:
        """Attention forwards sparse offload's replays run: one per replayed block, but none for a block that keeps
        its attention output under --replay-kept-attention (its kept one is read instead)."""
        replays = replays_per_layer(self.offloaded_layers(num_layers), self.offload_every_k_layers)
        reading = self.kept_attention_layers(num_layers) if self.replay_kept_attention else 0
        return sum(replays[reading:])

    def host_slots(self, num_layers: int) -> int:
        """Block inputs on the host at once (one per segment of offloaded layers)."""
        return self.sparse_offload(num_layers).kept_inputs

    # --- applying it ---------------------------------------------------------------------

    def offload_scheduler(self, num_layers: int, devices) -> OffloadScheduler | None:
        """The scheduler of the checkpointed blocks' inputs (None when nothing is offloaded)."""
        checkpointed = self.checkpointed_layers(num_layers)
        if not (self.offloads and checkpointed):
            return None
        return OffloadScheduler(checkpointed, keep_last=self.offload_keep_last, accelerator=devices.accelerator,
                                host=devices.host, prefetch=self.offload_mode != "on_demand",
                                prefetch_early=self.offload_mode == "early", every_k=self.offload_every_k_layers,
                                attention_layers=self.kept_attention_layers(num_layers),
                                replay_kept_attention=self.replay_kept_attention)

    def host_arenas(self, model, offload: OffloadScheduler, block: tuple[int, int, int], block_dtype: torch.dtype,
                    compute_dtype: torch.dtype) -> dict[ArenaKey, int]:
        """Every host arena a step of `model` (applied with `offload`) fills, with its slots, to be made before
        step 1: the block inputs' (`block` = [B, S/cp, hidden] in `block_dtype`) and, where offloaded blocks keep
        their attention, those of what its attention op puts on the host, as its backend declares for that
        micro-batch computed in `compute_dtype` (`kept_tensors`; the same for every layout of the documents)."""
        arenas = offload.input_arena(block, block_dtype)
        keeping = [layer for layer in model.layers if layer.memory.kept_attention is not None]
        if keeping and offload.attention_layers:
            kept = keeping[0].self_attn.backend.kept_tensors(block[0], block[1], model.config.num_attention_heads,
                                                             compute_dtype)
            slots = arena_slots(((t.shape, t.dtype) for t in kept), offload.attention_layers)
            arenas |= {(shape, dtype, ATTENTION_KIND): n for (shape, dtype), n in slots.items()}
        return arenas

    def apply(self, model, devices, bounds: TileBounds = tile_bounds,
              fp32_out_gemm: bool | None = None) -> OffloadScheduler | None:
        """Set each block's recompute, offload, kept attention and MLP tiles, and the head's loss tiles, on a
        (meta-device) Transformer, the tile loops running over `bounds` and summing 16-bit products in fp32 the
        `fp32_out_gemm` way (`tiling.addmm_fp32_`); returns the offload scheduler, if any."""
        self.validate()
        num_layers = model.config.num_layers
        offload = self.offload_scheduler(num_layers, devices)
        for i, layer in enumerate(model.layers):
            layer.memory.recompute = self.block_recompute(i, num_layers)
            layer.memory.offload = offload if layer.memory.recompute == "full" else None
            keeps = layer.memory.recompute == "full" and i < self.kept_attention_layers(num_layers)
            layer.memory.kept_attention = KeptAttention(layer.layer_idx) if keeps else None
            layer.mlp.num_tiles, layer.mlp.tile_bounds, layer.mlp.fp32_out_gemm = self.mlp_tiles, bounds, fp32_out_gemm
        model.head.loss_tiles, model.head.tile_bounds, model.head.fp32_out_gemm = self.loss_tiles, bounds, fp32_out_gemm
        return offload


def sparse_offload_counts(offloaded: int, k: int) -> SparseOffloadCounts:
    """Segments of k among `offloaded` layers: one kept input each; a segment of r layers replays r(r-1)/2
    block forwards, of which (r-1)(r-2)/2 gather parameters outside their layer's own pass."""
    if offloaded <= 0:
        return SparseOffloadCounts(0, 0, 0)
    full, rest = divmod(offloaded, k)
    sizes = [k] * full + ([rest] if rest else [])
    return SparseOffloadCounts(len(sizes), sum(r * (r - 1) // 2 for r in sizes),
                               sum((r - 1) * (r - 2) // 2 for r in sizes if r > 1))


def replays_per_layer(offloaded: int, k: int) -> list[int]:
    """How often sparse offload replays each of the `offloaded` layers in backward: in a segment of r layers the
    one at position p is replayed by the r - 1 - p layers after it."""
    return [min(k, offloaded - s) - 1 - (i - s) for s in range(0, offloaded, k)
            for i in range(s, min(s + k, offloaded))]


# --- the flags ---------------------------------------------------------------------------


@dataclass
class MemoryArgs:
    """The memory stack's flags (section `memory` of a run's config)."""

    recompute_granularity: str = flag("none", "activation checkpointing: none, full (keep block inputs only), "
                                      "selective (keep attention, recompute the MLP half)",
                                      choices=RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = flag(None, "with --recompute-granularity full, which blocks are checkpointed: "
                                        "block (the first --recompute-num-layers blocks, the rest keep all their "
                                        "activations) or uniform (groups of --recompute-num-layers blocks; only 1 "
                                        "here, each block its own group); default every block",
                                        choices=("uniform", "block"))
    recompute_num_layers: int | None = flag(None, "blocks per group (uniform) or blocks checkpointed (block)")
    offload_mode: str = flag("none", "keep checkpointed block inputs in host memory (needs full recompute): none; "
                             "prefetch (each comes back during the backward of the layer above, after its peak); "
                             "early (back from when that backward starts, so the copy runs during it: one block "
                             "input more on the accelerator at its peak); on_demand (back only when its own "
                             "backward needs it: one block input less, the copy exposed)", choices=OFFLOAD_MODES)
    offload_keep_last: int | None = flag(None, "with --offload-mode: the last checkpointed blocks whose inputs stay "
                                         "on the accelerator (default 1)")
    offload_every_k_layers: int = flag(1, "sparse offload: keep only every k-th offloaded block input (the first "
                                       "of each segment of k layers) and recompute the others from it in backward: "
                                       "about k x less host memory for (k-1)/2 more block forwards per layer")
    keep_attention_output: bool = flag(False, "with --recompute-granularity full, keep each block's attention "
                                       "output and log-sum-exp (in host memory with the block input under "
                                       "--offload-mode) so that the recompute does not run the attention "
                                       "forward again: about twice the kept bytes per layer, one attention "
                                       "forward less per layer")
    keep_attention_output_layers: int | None = flag(None, "with --keep-attention-output: only the first N "
                                                    "checkpointed blocks keep theirs (default: all): the kept bytes "
                                                    "of N blocks, N attention forwards less")
    replay_kept_attention: bool = flag(False, "with --offload-every-k-layers > 1 and --keep-attention-output: the "
                                       "blocks a segment replays in backward to rebuild the inputs it did not keep "
                                       "read their kept attention output and log-sum-exp (copied back from the "
                                       "host) instead of running the attention forward again: the replays are "
                                       "projections, norms and MLP only")
    tiled_mlp: bool = flag(False, "compute the MLP over sequence tiles, recomputed in backward")
    tiled_mlp_tiles: int | None = flag(None, "with --tiled-mlp: MLP tiles (default: about hidden-size tokens per tile)")
    tiled_loss: bool = flag(False, "fuse output projection and cross-entropy over sequence tiles")
    tiled_loss_tiles: int | None = flag(None, "with --tiled-loss: loss tiles (default: about 1 GiB of fp32 logits "
                                        "per tile)")

    def check(self, num_layers: int) -> None:
        """Flag rules: a flag that would change nothing without another is refused, naming it."""
        full = self.recompute_granularity == "full"
        if self.recompute_method is not None or self.recompute_num_layers is not None:
            if not full:
                raise ConfigError(f"--recompute-method {self.recompute_method} / --recompute-num-layers "
                                  f"{self.recompute_num_layers} choose the blocks of --recompute-granularity full "
                                  f"(given: {self.recompute_granularity})")
            if self.recompute_method is None or self.recompute_num_layers is None:
                raise ConfigError("--recompute-method and --recompute-num-layers go together: give both (without "
                                  "them, --recompute-granularity full checkpoints every block)")
            if not 1 <= self.recompute_num_layers <= num_layers:
                raise ConfigError(f"--recompute-num-layers {self.recompute_num_layers} must be in 1..{num_layers} "
                                  "(--num-layers)")
            if self.recompute_method == "uniform" and self.recompute_num_layers != 1:
                raise ConfigError(f"--recompute-method uniform --recompute-num-layers {self.recompute_num_layers}: "
                                  "checkpointing here is per block (each block one FSDP and offload unit that keeps "
                                  "its own input), so groups of several blocks are not; give 1, or --recompute-method "
                                  "block to checkpoint only the first N")
        if self.keep_attention_output_layers is not None:
            if not self.keep_attention_output:
                raise ConfigError(f"--keep-attention-output-layers {self.keep_attention_output_layers} chooses the "
                                  "blocks of --keep-attention-output: add it")
            if not 1 <= self.keep_attention_output_layers <= num_layers:
                raise ConfigError(f"--keep-attention-output-layers {self.keep_attention_output_layers} must be in "
                                  f"1..{num_layers} (--num-layers)")
        if self.offload_keep_last is not None and self.offload_mode == "none":
            raise ConfigError(f"--offload-keep-last {self.offload_keep_last} chooses which offloaded block inputs stay "
                              "on the accelerator: it needs --offload-mode (prefetch, early or on_demand)")
        for name, tiles, on, needs in (("--tiled-mlp-tiles", self.tiled_mlp_tiles, self.tiled_mlp, "--tiled-mlp"),
                                       ("--tiled-loss-tiles", self.tiled_loss_tiles, self.tiled_loss, "--tiled-loss")):
            if tiles is not None and not on:
                raise ConfigError(f"{name} {tiles} sets the tiles of {needs}: add {needs}")

    def stack(self, num_layers: int, chunks: ChunkPlan | None = None) -> MemoryStack:
        """The stack these flags ask for; `chunks` gives the default tile counts (needed with tiling)."""
        def tiles(on: bool, count: int | None, default: int | None) -> int | None:
            return (count or default) if on else None

        return MemoryStack(
            recompute_granularity=self.recompute_granularity,
            recompute_layers=(min(self.recompute_num_layers, num_layers) if self.recompute_method == "block"
                              and self.recompute_granularity == "full" else None),
            offload_mode=self.offload_mode,
            offload_keep_last=1 if self.offload_keep_last is None else self.offload_keep_last,
            offload_every_k_layers=self.offload_every_k_layers, keep_attention_output=self.keep_attention_output,
            keep_attention_layers=self.keep_attention_output_layers if self.keep_attention_output else None,
            replay_kept_attention=self.replay_kept_attention,
            mlp_tiles=tiles(self.tiled_mlp, self.tiled_mlp_tiles, chunks and chunks.mlp_tiles),
            loss_tiles=tiles(self.tiled_loss, self.tiled_loss_tiles, chunks and chunks.loss_tiles))


def fold_offload_aliases(values: dict) -> dict:
    """`values` (setting name -> value) with the old offload spellings folded into `offload_mode`:
    --offload-activations is prefetch, with --no-offload-prefetch on_demand, with --offload-prefetch-early
    early. Contradictions, or a modifier without --offload-activations, are refused in one line."""
    given = {name for name in OFFLOAD_ALIASES if values.get(name)}
    values = {k: v for k, v in values.items() if k not in OFFLOAD_ALIASES}
    if not given:
        return values
    if "offload_activations" not in given:
        modifier = "--" + sorted(given)[0].replace("_", "-")
        raise ConfigError(f"{modifier} changes how offloaded block inputs come back: it needs --offload-activations "
                          "(or give --offload-mode on_demand / early)")
    if {"no_offload_prefetch", "offload_prefetch_early"} <= given:
        raise ConfigError("--no-offload-prefetch and --offload-prefetch-early contradict each other: give one "
                          "--offload-mode (on_demand or early)")
    mode = "on_demand" if "no_offload_prefetch" in given else "early" if "offload_prefetch_early" in given \
        else "prefetch"
    if values.get("offload_mode") not in (None, "none", mode):
        raise ConfigError(f"--offload-mode {values['offload_mode']} and the old spelling of --offload-mode {mode} "
                          f"(--{' --'.join(sorted(n.replace('_', '-') for n in given))}): give one")
    return {**values, "offload_mode": mode}
