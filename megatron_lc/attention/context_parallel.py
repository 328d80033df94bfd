"""How attention runs over the context-parallel ranks, defined once: the layout (all-to-all degree x ring),
the all-to-all implementation, Untied Ulysses' stage width resolved, its pipelining, the local kernel and
what runs behind torch's flash kernel. The parallelize step, the time model and auto-fit read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from megatron_lc.attention.ulysses import check_ulysses_shapes
from megatron_lc.attention.ring import RING_KV_GRADS, RingKvGrads
from megatron_lc.attention.untied_plan import BACKWARD_MEMORY, BackwardMemory, check_untied_shapes
from megatron_lc.context_layout import CP_COMM_TYPES, DOCUMENT_LAYOUTS, ContextLayout, DocumentLayout
from megatron_lc.errors import ConfigError
from megatron_lc.flags import flag, flag_list

CpImpl = Literal["ulysses", "untied_ulysses"]
CP_IMPLS: tuple[str, ...] = get_args(CpImpl)


@dataclass(frozen=True)
class ContextParallel:
    """The context-parallel attention of a run (`--context-parallel-size`, `--cp-comm-type`,
    `--hierarchical-context-parallel-sizes`, `--cp-impl`, `--untied-*`, `--attention-kernel`,
    `--flash-attention-impl`)."""

    layout: ContextLayout | None = None
    """The all-to-all degree and the ring degree; None: the process mesh's (`on` fills it in). Its document layout
    is `documents`."""
    documents: DocumentLayout = "sequence"
    """How a ring cuts a sample of documents (`--cp-document-layout`, `ContextLayout.documents`)."""
    impl: CpImpl = "ulysses"
    """The all-to-all level's attention: Ulysses, or Untied Ulysses (heads in stages)."""
    heads_per_stage: int | None = None
    """Untied Ulysses' stage width as given (None: the all-to-all degree); `stage_heads` is the resolved one."""
    overlap: bool = False
    """Untied Ulysses: the next stage's projections and exchanges in flight while a stage attends."""
    untied_backward: BackwardMemory = "fast"
    """What Untied Ulysses' backward holds (`UntiedUlyssesAttention.backward_memory`)."""
    ring_kv_grads: RingKvGrads = "overlapped"
    """Ring attention's backward: its dK/dV accumulators travel while the next block attends, or are rotated in
    place (`RingAttention.kv_grads`)."""
    kernel: str = "auto"
    """The local attention kernel (`--attention-kernel`)."""
    flash_impl: str = "auto"
    """What runs behind torch's flash kernel (`--flash-attention-impl`)."""

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout.documents != self.documents:
            object.__setattr__(self, "layout", dataclasses.replace(self.layout, documents=self.documents))

    def on(self, layout: ContextLayout) -> ContextParallel:
        """This spec on the mesh's `layout` (refused when it has other degrees; the document layout is the spec's:
        the mesh knows none)."""
        if self.layout is None:
            return dataclasses.replace(self, layout=layout)
        if (self.layout.a2a_size, self.layout.ring_size) != (layout.a2a_size, layout.ring_size):
            raise ValueError(f"the context-parallel spec is for {self.layout}, the process mesh has {layout}")
        return self

    @property
    def _layout(self) -> ContextLayout:
        if self.layout is None:
            raise ValueError("the context-parallel layout is not set: call on(pstate.context_layout)")
        return self.layout

    @property
    def size(self) -> int:
        return self._layout.cp_size

    @property
    def all_to_all(self) -> bool:
        """Whether there is an all-to-all level (more than one rank in it)."""
        return self._layout.a2a_size > 1

    @property
    def untied(self) -> bool:
        """Whether Untied Ulysses runs (the implementation, on an all-to-all level)."""
        return self.impl == "untied_ulysses" and self.all_to_all

    @property
    def stage_heads(self) -> int | None:
        """Heads per Untied Ulysses stage, resolved (the all-to-all degree unless given); None without it."""
        return (self.heads_per_stage or self._layout.a2a_size) if self.untied else None

    def validate(self, num_heads: int, num_kv_heads: int, seq_length: int) -> None:
        """Refuse what cannot run, naming the flags (ConfigError or ValueError with the flag)."""
        if self.impl not in CP_IMPLS:
            raise ConfigError(f"--cp-impl {self.impl!r}: expected one of {', '.join(CP_IMPLS)}")
        self._layout.check(seq_length)
        if self._layout.documents not in DOCUMENT_LAYOUTS:
            raise ConfigError(f"--cp-document-layout {self._layout.documents!r}: expected one of "
                              f"{', '.join(DOCUMENT_LAYOUTS)}")
        if self._layout.documents != "sequence" and self._layout.ring_size < 2:
            raise ConfigError(f"--cp-document-layout {self._layout.documents} cuts a ring by documents: it needs a "
                              "ring (--cp-comm-type p2p or a2a+p2p); all-to-all ranks attend over every document, "
                              "their share of the heads each, balanced as they are")
        if self.heads_per_stage is not None and self.impl != "untied_ulysses":
            raise ConfigError(f"--untied-heads-per-stage {self.heads_per_stage} sets the stages of Untied Ulysses: "
                              f"it needs --cp-impl untied_ulysses (given: {self.impl})")
        if self.overlap and not (self.impl == "untied_ulysses" and self.size > 1):
            raise ConfigError("--untied-overlap-stages pipelines the stages of Untied Ulysses: it needs "
                              "--cp-impl untied_ulysses and --context-parallel-size > 1")
        if self.untied_backward not in BACKWARD_MEMORY:
            raise ConfigError(f"--untied-backward {self.untied_backward!r}: expected one of {', '.join(BACKWARD_MEMORY)}")
        if self.ring_kv_grads not in RING_KV_GRADS:
            raise ConfigError(f"--ring-kv-grads {self.ring_kv_grads!r}: expected one of {', '.join(RING_KV_GRADS)}")
        if self.untied_backward != "fast" and not self.untied:
            raise ConfigError(f"--untied-backward {self.untied_backward} sets what Untied Ulysses' backward holds: it needs "
                              "--cp-impl untied_ulysses with an all-to-all level (--context-parallel-size > 1, "
                              "--cp-comm-type a2a or a2a+p2p)")
        if self.ring_kv_grads != "overlapped" and self._layout.ring_size < 2:
            raise ConfigError(f"--ring-kv-grads {self.ring_kv_grads} sets ring attention's backward: it needs a ring "
                              "(--cp-comm-type p2p or a2a+p2p)")
        if self.size > 1 and not self.all_to_all and self.impl != "ulysses":
            raise ConfigError(f"--cp-impl {self.impl} and --untied-heads-per-stage choose the all-to-all level, which "
                              f"--cp-comm-type {self._layout.comm_type} with a ring of all {self.size} ranks does "
                              "not have")
        if self.flash_impl in ("fa3", "fa4") and self.kernel not in ("auto", "sdpa_flash"):
            raise ConfigError(f"--flash-attention-impl {self.flash_impl} runs behind torch's flash kernel, which "
                              f"--attention-kernel {self.kernel} does not use: give --attention-kernel auto or "
                              "sdpa_flash, or drop --flash-attention-impl")
        if self.all_to_all:
            a2a = self._layout.a2a_size
            try:
                check_ulysses_shapes(num_heads, num_kv_heads, a2a)
                if self.untied:
                    check_untied_shapes(num_heads, num_kv_heads, a2a, self.stage_heads)
            except ValueError as e:
                if a2a == self.size:
                    raise
                raise ValueError(f"{e} [the all-to-all degree is {a2a}, the first of "
                                 "--hierarchical-context-parallel-sizes]") from e


@dataclass
class ParallelArgs:
    context_parallel_size: int = flag(1, "context-parallel degree: each sequence is split over this many ranks")
    cp_impl: str = flag("ulysses", "context-parallel attention of the all-to-all level", choices=CP_IMPLS)
    cp_comm_type: str = flag("a2a", "context-parallel communication: a2a (all-to-all, --cp-impl), p2p (ring "
                             "attention over the cp group), a2a+p2p (all-to-all inside groups of contiguous ranks, "
                             "a ring across them; see --hierarchical-context-parallel-sizes)",
                             choices=CP_COMM_TYPES)
    hierarchical_context_parallel_sizes: list[int] = flag_list(
        "with --cp-comm-type a2a+p2p: A R, the all-to-all degree (contiguous ranks: a node) and the ring degree; "
        "A x R = --context-parallel-size")
    cp_document_layout: str | None = flag(
        None, "how a ring (--cp-comm-type p2p or a2a+p2p) cuts a sample of several documents (--packing "
        "documents, --reset-attention-mask): sequence (the sample's 2R chunks, whatever its documents), split "
        "(each document cut head-tail over the ring: the same attention work on every ring rank) or local "
        "(documents with little attention whole on one ring rank, balanced by work, never travelling the ring; "
        "the others cut head-tail). Default: split with a ring", choices=DOCUMENT_LAYOUTS)
    untied_heads_per_stage: int | None = flag(None, "Untied Ulysses heads per stage (a multiple of the all-to-all "
                                              "degree; default that degree)")
    untied_overlap_stages: bool = flag(False, "Untied Ulysses: the next stage's projections and all-to-alls in "
                                       "flight while a stage attends, forward and backward (one more set of "
                                       "stage buffers)")
    untied_backward: str = flag("fast", "what Untied Ulysses' backward holds: fast (a kv round's dK/dV summed over "
                                "its stages in fp32 and sent back once; the attention output kept whole) or lean "
                                "(each stage's dK/dV sent back with its dQ, no fp32 sums; the output kept by stage "
                                "and each stage's freed once sent: less memory at the backward's peak, more bytes "
                                "exchanged)", choices=BACKWARD_MEMORY)
    ring_kv_grads: str = flag("overlapped", "ring attention's backward: overlapped (the fp32 dK/dV accumulators travel "
                              "while the next block attends: two pairs held, the kernels' shares kept until one "
                              "arrives) or in_place (rotated in place after each step through a small staging "
                              "buffer, the shares added as made: one pair held, the rotation not hidden)",
                              choices=RING_KV_GRADS)
    attention_kernel: str = flag("auto", "local attention kernel",
                                 choices=("auto", "flash_attn", "sdpa_flash", "sdpa_efficient", "cpu_flash",
                                          "reference"))
    flash_attention_impl: str = flag("auto", "what runs torch's flash kernels, through torch's registry "
                                     "(torch.nn.attention.activate_flash_attention_impl): auto (FA3 on compute "
                                     "capability 9.0 when flash_attn_interface imports, FA4 on 10.0 when "
                                     "flash_attn.cute imports, else torch's own), default, fa3, fa4",
                                     choices=("auto", "default", "fa3", "fa4"))
    distributed_timeout_minutes: int = flag(10, "timeout of the process group's collectives, in minutes "
                                                "(init_process_group's timeout, as Megatron-LM)")
    tensor_model_parallel_size: int = flag(1, "Megatron-LM's tensor parallelism: only 1 (FSDP2 + context "
                                           "parallelism shard the model and the sequence instead)")
    pipeline_model_parallel_size: int = flag(1, "Megatron-LM's pipeline parallelism: only 1 (FSDP2 shards the "
                                             "layers' parameters instead)")
    sequence_parallel: bool = flag(False, "Megatron-LM's sequence parallelism (of tensor parallelism): refused; "
                                   "--context-parallel-size splits the sequence instead")
