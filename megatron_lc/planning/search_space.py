"""Auto-fit's search space: the memory stacks it tries (`Candidate`), ordered from the least saving to the
most, and the flags each one sets."""


from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

from megatron_lc.attention.registry import CP_IMPLS
from megatron_lc.attention.untied_plan import valid_heads_per_stage
from megatron_lc.config import TrainConfig
from megatron_lc.memory.chunks import plan_chunks
from megatron_lc.memory.stack import OffloadMode


MODES = (("none", "none"), ("selective", "none"), ("full", "none"), ("full", "early"), ("full", "prefetch"),
         ("full", "on_demand"))
"""(recompute granularity, offload) from the least memory saving to the most."""
OFFLOAD_ORDER = ("early", "prefetch", "on_demand")
"""Offload modes from the one that holds most on the GPU at a block's backward peak to the one that holds least."""
OFFLOAD_EVERY = (1, 2, 4)
"""Sparse-offload levels auto-fit tries: every block input kept, every second, every fourth."""


@dataclass(frozen=True)
class Candidate:
    """One memory stack: the choices auto-fit makes, everything else as configured."""

    recompute: str
    """--recompute-granularity: none, selective or full."""
    offload: OffloadMode
    """--offload-mode: none, early, prefetch or on_demand."""
    mlp_tiles: int | None
    """--tiled-mlp-tiles, or None for no tiled MLP."""
    loss_tiles: int | None
    """--tiled-loss-tiles, or None for no tiled loss."""
    cp_impl: str | None
    """--cp-impl (None without context parallelism: left as configured)."""
    heads_per_stage: int | None
    """--untied-heads-per-stage (Untied Ulysses only)."""
    offload_every: int = 1
    """--offload-every-k-layers (with offload only): every k-th block input kept, the rest recomputed."""
    keep_attention: bool = False
    """--keep-attention-output (full recompute only): the recompute runs no attention forward; with sparse offload
    (k > 1) its replays read the kept outputs too (--replay-kept-attention: no attention forward in them either)."""
    untied_overlap: bool = False
    """--untied-overlap-stages (Untied Ulysses only): its stages pipelined, one more set of stage buffers."""
    offload_keep_last: int | None = None
    """--offload-keep-last as the user gave it (with offload only; None: the default)."""
    keep_attention_layers: int | None = None
    """--keep-attention-output-layers (with keep_attention): only the first this many blocks keep (None: all)."""
    untied_backward: str = "fast"
    """--untied-backward (Untied Ulysses only): `lean` holds no fp32 dK/dV sums and frees the output stage by stage,
    for more bytes exchanged."""
    ring_kv_grads: str = "overlapped"
    """--ring-kv-grads (with a ring only): `in_place` holds one pair of fp32 dK/dV accumulators, rotated exposed."""
    optimizer_on_host: bool = False
    """--optimizer-cpu-offload: master weights, Adam moments and gradients on the host, the step there."""

    def flags(self) -> list[str]:
        """The training flags of this stack (defaults left out)."""
        out = [] if self.recompute == "none" else ["--recompute-granularity", self.recompute]
        if self.offload != "none":
            out += ["--offload-mode", self.offload]
        if self.offload != "none" and self.offload_keep_last is not None:
            out += ["--offload-keep-last", str(self.offload_keep_last)]
        if self.offload != "none" and self.offload_every > 1:
            out += ["--offload-every-k-layers", str(self.offload_every)]
        if self.keep_attention and self.recompute == "full":
            out.append("--keep-attention-output")
            if self.keep_attention_layers is not None:
                out += ["--keep-attention-output-layers", str(self.keep_attention_layers)]
            if self.replays_read_kept_attention:
                out.append("--replay-kept-attention")
        if self.mlp_tiles:
            out += ["--tiled-mlp", "--tiled-mlp-tiles", str(self.mlp_tiles)]
        if self.loss_tiles:
            out += ["--tiled-loss", "--tiled-loss-tiles", str(self.loss_tiles)]
        if self.cp_impl == "untied_ulysses":
            out += ["--cp-impl", self.cp_impl, "--untied-heads-per-stage", str(self.heads_per_stage)]
            out += ["--untied-overlap-stages"] if self.untied_overlap else []
            out += ["--untied-backward", self.untied_backward] if self.untied_backward != "fast" else []
        if self.ring_kv_grads != "overlapped":
            out += ["--ring-kv-grads", self.ring_kv_grads]
        if self.optimizer_on_host:
            out.append("--optimizer-cpu-offload")
        return out

    @property
    def replays_read_kept_attention(self) -> bool:
        """Kept attention under sparse offload: its replays read the kept outputs. Not searched apart: a replay
        then copies the output and lse back instead of running its attention forward, faster on an H100 from about
        12K tokens per sample (T x heads x (2d + 4) bytes at 50 GB/s against 2 x S x T x d x heads FLOPs at about
        600 TFLOP/s), where sparse offload is ever needed."""
        return self.keep_attention and self.recompute == "full" and self.offload != "none" and self.offload_every > 1

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` with this stack in place of its own."""
        memory = dataclasses.replace(
            cfg.memory, recompute_granularity=self.recompute, offload_mode=self.offload,
            offload_keep_last=self.offload_keep_last if self.offload != "none" else None,
            offload_every_k_layers=self.offload_every if self.offload != "none" else 1,
            keep_attention_output=self.keep_attention and self.recompute == "full",
            keep_attention_output_layers=self.keep_attention_layers if self.keep_attention else None,
            replay_kept_attention=self.replays_read_kept_attention,
            tiled_mlp=self.mlp_tiles is not None,
            tiled_mlp_tiles=self.mlp_tiles, tiled_loss=self.loss_tiles is not None, tiled_loss_tiles=self.loss_tiles)
        parallel = dataclasses.replace(cfg.parallel, ring_kv_grads=self.ring_kv_grads)
        if self.cp_impl is not None:
            untied = self.cp_impl == "untied_ulysses"
            parallel = dataclasses.replace(parallel, cp_impl=self.cp_impl, untied_heads_per_stage=self.heads_per_stage,
                                           untied_overlap_stages=self.untied_overlap and untied,
                                           untied_backward=self.untied_backward if untied else "fast")
        optim = dataclasses.replace(cfg.optim, optimizer_cpu_offload=self.optimizer_on_host)
        return dataclasses.replace(cfg, memory=memory, parallel=parallel, optim=optim)


MEMORY_FLAGS = {"--recompute-granularity": 1, "--offload-mode": 1, "--offload-activations": 0,
                "--no-offload-prefetch": 0, "--offload-prefetch-early": 0,
                "--offload-every-k-layers": 1, "--offload-keep-last": 1, "--keep-attention-output": 0,
                "--keep-attention-output-layers": 1, "--replay-kept-attention": 0,
                "--tiled-mlp": 0, "--tiled-mlp-tiles": 1, "--tiled-loss": 0, "--tiled-loss-tiles": 1,
                "--cp-impl": 1, "--untied-heads-per-stage": 1, "--untied-overlap-stages": 0, "--untied-backward": 1,
                "--ring-kv-grads": 1, "--optimizer-cpu-offload": 0}
"""The flags auto-fit chooses, with the number of values each takes."""


def strip_memory_flags(argv: list[str]) -> list[str]:
    """`argv` without the flags auto-fit chooses (`--flag value` and `--flag=value` forms)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg.split("=", 1)[0] in MEMORY_FLAGS:
            skip = 0 if "=" in arg else MEMORY_FLAGS[arg]
        else:
            out.append(arg)
    return out


# --- the candidates -------------------------------------------------------------------------


def tile_ladder(default: int) -> list[int]:
    """Tile counts tried: the default, halved (rounded up) while it stays >= 2; ascending."""
    ladder, t = {default}, default
    while t > 2:
        t = math.ceil(t / 2)
        ladder.add(t)
    return sorted(ladder)


class AttentionLevel(NamedTuple):
    """One level of the attention choice: the all-to-all implementation and how its backward exchanges."""

    impl: str | None
    """--cp-impl (None without an all-to-all level: left as configured)."""
    heads_per_stage: int | None = None
    overlap: bool = False
    """Pipelined Untied stages."""
    untied_backward: str = "fast"
    """--untied-backward."""
    ring_kv_grads: str = "overlapped"
    """--ring-kv-grads."""

    @property
    def kind(self) -> tuple:
        """Levels of one kind differ in stage width only, ordered from the least memory saving to the most."""
        return self.impl, self.overlap, self.lean

    @property
    def lean(self) -> bool:
        """The lean backward: Untied Ulysses' (no fp32 round sums, its output freed by stage), the ring's
        accumulators rotated in place."""
        return self.untied_backward != "fast" or self.ring_kv_grads != "overlapped"


@dataclass(frozen=True)
class SearchSpace:
    """Each choice's levels, from the least memory saving to the most; a point indexes one level of each."""

    modes: tuple[tuple[str, str], ...]
    """(recompute, offload) levels."""
    mlp_tiles: tuple[int | None, ...]
    """MLP tile counts (None: not tiled)."""
    loss_tiles: tuple[int | None, ...]
    """Loss tile counts (None: not tiled)."""
    attention: tuple[AttentionLevel, ...]
    """Attention levels: Ulysses, then Untied Ulysses by heads per stage, descending, synchronous, then the same
    pipelined; then, where they change anything, the same with the lean backward exchanges (a kind of their own)."""
    offload_every: tuple[int, ...] = (1,)
    """Sparse-offload k levels (ascending; they apply to the offloading modes only)."""
    offload_keep_last: int | None = None
    """--offload-keep-last of every offloading candidate (as the user gave it)."""
    keep_attention: tuple[bool, ...] = (False,)
    """Kept attention levels, (True, False) when searched (they apply to full recompute only; the other
    modes keep their attention anyway and take level 0)."""
    optimizer_on_host: bool = False
    """Every candidate's optimizer on the host (--optimizer-cpu-offload)."""

    @property
    def sizes(self) -> tuple[int, ...]:
        return (len(self.modes), len(self.mlp_tiles), len(self.loss_tiles), len(self.attention),
                len(self.offload_every), len(self.keep_attention))

    def offloads(self, point: tuple[int, ...]) -> bool:
        return self.modes[point[0]][1] != "none"

    def canonical(self, point: tuple[int, ...]) -> tuple[int, ...]:
        """The point itself, or without offload its k level at 1 (k means nothing there), and without full
        recompute its kept-attention level at 0."""
        k = point[4] if self.offloads(point) else 0
        keep = point[5] if self.modes[point[0]][0] == "full" else 0
        return (*point[:4], k, keep)

    def candidate(self, point: tuple[int, ...]) -> Candidate:
        (rec, off), mlp, loss, level = (self.modes[point[0]], self.mlp_tiles[point[1]], self.loss_tiles[point[2]],
                                        self.attention[point[3]])
        return Candidate(rec, off, mlp, loss, level.impl, level.heads_per_stage,
                         self.offload_every[point[4]] if off != "none" else 1,
                         self.keep_attention[point[5]] and rec == "full", level.overlap,
                         self.offload_keep_last if off != "none" else None, untied_backward=level.untied_backward,
                         ring_kv_grads=level.ring_kv_grads, optimizer_on_host=self.optimizer_on_host)

    def points(self) -> list[tuple[int, ...]]:
        """Every distinct candidate's point (k levels only with offload)."""
        return [p for p in itertools.product(*(range(n) for n in self.sizes)) if self.canonical(p) == p]


def search_space(cfg: TrainConfig, num_gpus: int) -> SearchSpace:
    """The candidates for `cfg` on `num_gpus` GPUs: its model, length and cp degree fixed."""
    spec = cfg.run_spec(num_gpus)
    c, cp = spec.model, spec.dims.cp
    tokens = cfg.data.micro_batch_size * cfg.data.seq_length // cp
    plan = plan_chunks(tokens, c.hidden_size, c.ffn_hidden_size, c.vocab_size, 2 if cfg.train.bf16 else 4)
    layout = spec.parallelize.cp.layout
    a2a, ring = layout.a2a_size, layout.ring_size > 1  # the all-to-all level (the whole cp group without a ring)
    attention = [AttentionLevel(None)]
    if a2a > 1:
        attention = [AttentionLevel("ulysses")]
        if "untied_ulysses" in CP_IMPLS:
            stages = sorted(valid_heads_per_stage(c.num_attention_heads, c.num_query_groups, a2a), reverse=True)
            attention += [AttentionLevel("untied_ulysses", u, overlap) for overlap in (False, True)
                          for u in stages if u < c.num_attention_heads]
    ring_kv_grads = "in_place" if ring else "overlapped"
    lean = []
    for level in attention:
        untied = level.impl == "untied_ulysses"
        if untied or ring:
            lean.append(level._replace(untied_backward="lean" if untied else "fast", ring_kv_grads=ring_kv_grads))
    attention += lean
    offloading = dataclasses.replace(spec.parallelize.memory, recompute_granularity="full", offload_mode="prefetch")
    slots = {}  # k levels that change the host slots (a model of few layers has fewer)
    for k in OFFLOAD_EVERY:
        slots.setdefault(dataclasses.replace(offloading, offload_every_k_layers=k).host_slots(c.num_layers), k)
    return SearchSpace(MODES, (None, *tile_ladder(plan.mlp_tiles)), (None, *tile_ladder(plan.loss_tiles)),
                       tuple(attention), tuple(slots.values()), cfg.memory.offload_keep_last, (True, False),
                       cfg.optim.optimizer_cpu_offload)
