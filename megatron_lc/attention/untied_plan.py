"""Untied Ulysses' stage plan: which heads go where, checked against heads, kv heads and cp.

Pure arithmetic, with the flag and the backward-memory modes it is configured by: what the planner and the
configuration read without the op (`attention/untied_ulysses.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from megatron_lc.attention.kernels import kept_outputs
from megatron_lc.attention.ulysses import check_ulysses_shapes, kv_replication
from megatron_lc.memory.kept_attention import KeptTensor

HEADS_PER_STAGE_FLAG = "--untied-heads-per-stage"
BackwardMemory = Literal["fast", "lean"]
BACKWARD_MEMORY: tuple[str, ...] = get_args(BackwardMemory)


@dataclass(frozen=True)
class StagePlan:
    """How H q heads and Hkv kv heads are split into stages and kv rounds over cp ranks."""

    num_heads: int
    num_kv_heads: int
    cp: int
    heads_per_stage: int

    @property
    def kv_replication(self) -> int:
        """Copies of each kv head so every rank receives one (1 when Hkv >= cp)."""
        return kv_replication(self.num_kv_heads, self.cp)

    @property
    def q_heads_per_rank(self) -> int:
        return self.num_heads // self.cp

    @property
    def kv_heads_per_rank(self) -> int:
        return self.num_kv_heads * self.kv_replication // self.cp

    @property
    def group_size(self) -> int:
        """q heads per (replicated) kv head."""
        return self.num_heads // (self.num_kv_heads * self.kv_replication)

    @property
    def stage_heads_per_rank(self) -> int:
        """q heads each rank attends in one stage (U / cp)."""
        return self.heads_per_stage // self.cp

    @property
    def kv_heads_per_round(self) -> int:
        """kv heads each rank receives per kv round."""
        return max(1, self.stage_heads_per_rank // self.group_size)

    @property
    def stages_per_round(self) -> int:
        """Stages that reuse one round's kv heads."""
        return max(1, self.group_size // self.stage_heads_per_rank)

    @property
    def num_stages(self) -> int:
        return self.num_heads // self.heads_per_stage

    @property
    def num_rounds(self) -> int:
        return self.num_stages // self.stages_per_round

    def stages(self, kv_round: int) -> range:
        """Stages served by the kv heads of `kv_round`."""
        return range(kv_round * self.stages_per_round, (kv_round + 1) * self.stages_per_round)

    def kept(self, batch: int, tokens: int, head_dim: int, dtype: torch.dtype, by_stage: bool) -> list[KeptTensor]:
        """What the op puts on the host for a keeping block of `batch` samples of `tokens` local tokens (`wo` given,
        as the model's attention gives it): the output [B, S/cp, H*d], or each stage's [B, S/cp, cp, U/cp, d]
        (`by_stage`), and each stage's lse [U/cp, B*S] (a ring's: of the ring rank's tokens)."""
        u, stages = self.stage_heads_per_rank, self.num_stages
        lse = kept_outputs(batch * tokens * self.cp, u, head_dim, dtype)[1]
        outs = ([KeptTensor((batch, tokens, self.cp, u, head_dim), dtype)] * stages if by_stage
                else [KeptTensor((batch, tokens, self.num_heads * head_dim), dtype)])
        return [*outs, *[lse] * stages]

    def aligned(self) -> bool:
        """Stages align with GQA groups: U/cp divides, or is a multiple of, the group size."""
        u, g = self.stage_heads_per_rank, self.group_size
        return u > 0 and (g % u == 0 or u % g == 0)


def valid_heads_per_stage(num_heads: int, num_kv_heads: int, cp: int) -> list[int]:
    """Every U accepted for this configuration."""
    return [u for u in range(cp, num_heads + 1, cp)
            if num_heads % u == 0 and StagePlan(num_heads, num_kv_heads, cp, u).aligned()]


def check_untied_shapes(num_heads: int, num_kv_heads: int, cp: int, heads_per_stage: int) -> StagePlan:
    """Configuration-time check of U against heads, kv heads and cp; returns the plan."""
    check_ulysses_shapes(num_heads, num_kv_heads, cp)
    valid = valid_heads_per_stage(num_heads, num_kv_heads, cp)
    hint = f"valid values here: {', '.join(map(str, valid))}"
    u = heads_per_stage
    if not isinstance(u, int) or u <= 0 or u % cp:
        raise ValueError(f"{HEADS_PER_STAGE_FLAG} {u} must be a positive multiple of --context-parallel-size "
                         f"{cp} (each rank takes U/cp heads per stage); {hint}")
    if num_heads % u:
        raise ValueError(f"{HEADS_PER_STAGE_FLAG} {u} must divide --num-attention-heads {num_heads}; {hint}")
    plan = StagePlan(num_heads, num_kv_heads, cp, u)
    if not plan.aligned():
        raise ValueError(f"{HEADS_PER_STAGE_FLAG} {u}: the {u // cp} heads per rank per stage must divide, or be "
                         f"a multiple of, the {plan.group_size} q heads sharing a kv head, so stages align with "
                         f"GQA groups; {hint}")
    return plan
