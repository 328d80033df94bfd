"""Chunk scheduler: how many tiles the MLP and the loss run in, and heads per attention stage.

The plan depends on configuration values only (never on data or on the rank), so every
rank computes the same plan and runs the same number of tiles. That matters under
sharded parameters: ranks that disagree on a loop count disagree on the number of
collectives and deadlock.

Automatic choices (when a count is not given explicitly):

- MLP: the smallest tile count whose intermediate tile (``rows x ffn_hidden_size x
  dtype_bytes``) fits the intermediate of ``hidden_size`` rows (times
  ``DEFAULT_MLP_TILE_TOKENS_PER_HIDDEN``), i.e. tiles of about ``hidden_size`` tokens
  and ``ceil(local_tokens / hidden_size)`` tiles, as ALST does. A tile's intermediate is
  then about the size of one MLP weight matrix, so tiling adds no more memory than the
  weights already take, and the tile GEMMs (hidden x hidden x ffn) stay large enough
  to be compute bound.
- Loss: the smallest tile count whose fp32 logits tile (``rows x vocab_size x 4``)
  fits ``DEFAULT_LOSS_BUDGET_BYTES`` (1 GiB, as ALST).
- Attention head stages (Untied Ulysses): ``heads_per_stage = context_parallel_size``
  (one head per GPU per stage, the largest saving) when the head count and the
  context-parallel size are given; otherwise left to the attention backend (None).

An explicit ``budget_bytes`` replaces both automatic budgets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Bytes of one fp32 logit: the loss tile is always upcast to fp32.
FP32_BYTES = 4
# Default fp32 logits tile budget (ALST uses shards of about 1 GiB of logits).
DEFAULT_LOSS_BUDGET_BYTES = 1 << 30
# Default MLP tile length as a multiple of hidden_size (ALST: ceil(tokens / hidden)).
DEFAULT_MLP_TILE_TOKENS_PER_HIDDEN = 1
_VALID_DTYPE_BYTES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ChunkPlan:
    """Tile counts for one micro-batch; identical on every rank.

    Attributes:
        mlp_tiles: sequence tiles of the (Tiled) MLP.
        loss_tiles: row tiles of the fused linear cross-entropy.
        heads_per_stage: attention heads per Untied Ulysses stage, or None to let
            the attention backend decide.
    """

    mlp_tiles: int
    loss_tiles: int
    heads_per_stage: int | None


def _require_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is a positive int (bools rejected), else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def tiles_for_budget(rows: int, bytes_per_row: int, budget_bytes: int, what: str) -> int:
    """Smallest tile count such that a tile of ``ceil(rows / tiles)`` rows fits the budget.

    Raises ValueError when even a single row exceeds ``budget_bytes``.
    """
    rows_per_tile = budget_bytes // bytes_per_row
    if rows_per_tile < 1:
        raise ValueError(
            f"{what}: one row needs {bytes_per_row} bytes, more than "
            f"budget_bytes={budget_bytes}; raise the budget"
        )
    return math.ceil(rows / rows_per_tile)


def _explicit_tiles(name: str, tiles: int, local_tokens: int) -> int:
    """Validate an explicitly requested tile count against the local token count."""
    _require_positive_int(name, tiles)
    if tiles > local_tokens:
        raise ValueError(f"{name}={tiles} exceeds local_tokens={local_tokens}")
    return tiles


def _plan_heads_per_stage(
    heads_per_stage: int | None,
    num_attention_heads: int | None,
    context_parallel_size: int | None,
) -> int | None:
    """Validate or pick the Untied Ulysses stage width (heads per stage, all ranks)."""
    if num_attention_heads is not None:
        _require_positive_int("num_attention_heads", num_attention_heads)
    if context_parallel_size is not None:
        _require_positive_int("context_parallel_size", context_parallel_size)
    if heads_per_stage is None:
        if num_attention_heads is None or context_parallel_size is None:
            return None
        heads_per_stage = context_parallel_size
    _require_positive_int("heads_per_stage", heads_per_stage)
    if context_parallel_size is not None and heads_per_stage % context_parallel_size:
        raise ValueError(
            f"heads_per_stage={heads_per_stage} must be a multiple of "
            f"context_parallel_size={context_parallel_size}"
        )
    if num_attention_heads is not None and num_attention_heads % heads_per_stage:
        raise ValueError(
            f"heads_per_stage={heads_per_stage} must divide "
            f"num_attention_heads={num_attention_heads}"
        )
    return heads_per_stage


def plan_chunks(
    local_tokens: int,
    hidden_size: int,
    ffn_hidden_size: int,
    vocab_size: int,
    dtype_bytes: int,
    *,
    mlp_tiles: int | None = None,
    loss_tiles: int | None = None,
    budget_bytes: int | None = None,
    heads_per_stage: int | None = None,
    num_attention_heads: int | None = None,
    context_parallel_size: int | None = None,
) -> ChunkPlan:
    """Plan tile counts from configuration alone (the same on every rank).

    Args:
        local_tokens: tokens of one micro-batch on this rank (sequence / cp x batch).
        hidden_size, ffn_hidden_size, vocab_size: model sizes.
        dtype_bytes: bytes per element of the MLP activations (2 for bf16, 4 for fp32).
        mlp_tiles, loss_tiles: explicit counts; they win over the automatic choice.
        budget_bytes: per-buffer budget for both automatic choices; None uses the
            defaults in the module docstring (tiles of ~hidden_size tokens for the MLP,
            1 GiB of fp32 logits for the loss).
        heads_per_stage, num_attention_heads, context_parallel_size: Untied Ulysses
            stage width; explicit value validated, else cp when heads and cp are given.
    """
    for name, value in (
        ("local_tokens", local_tokens),
        ("hidden_size", hidden_size),
        ("ffn_hidden_size", ffn_hidden_size),
        ("vocab_size", vocab_size),
    ):
        _require_positive_int(name, value)
    _require_positive_int("dtype_bytes", dtype_bytes)
    if dtype_bytes not in _VALID_DTYPE_BYTES:
        raise ValueError(f"dtype_bytes must be one of {_VALID_DTYPE_BYTES}, got {dtype_bytes}")
    if budget_bytes is not None:
        _require_positive_int("budget_bytes", budget_bytes)

    if mlp_tiles is not None:
        mlp = _explicit_tiles("mlp_tiles", mlp_tiles, local_tokens)
    else:
        mlp_budget = budget_bytes or (
            DEFAULT_MLP_TILE_TOKENS_PER_HIDDEN * hidden_size * ffn_hidden_size * dtype_bytes
        )
        mlp = tiles_for_budget(local_tokens, ffn_hidden_size * dtype_bytes, mlp_budget, "MLP tile")

    if loss_tiles is not None:
        loss = _explicit_tiles("loss_tiles", loss_tiles, local_tokens)
    else:
        loss_budget = budget_bytes or DEFAULT_LOSS_BUDGET_BYTES
        loss = tiles_for_budget(local_tokens, vocab_size * FP32_BYTES, loss_budget, "loss tile")

    stage = _plan_heads_per_stage(heads_per_stage, num_attention_heads, context_parallel_size)
    return ChunkPlan(mlp_tiles=mlp, loss_tiles=loss, heads_per_stage=stage)
