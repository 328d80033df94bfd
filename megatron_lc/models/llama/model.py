"""The LLaMA decoder, read top to bottom.

Parameter names follow `transformers`' LlamaForCausalLM (minus its `model.` prefix), so
weights map one to one. Rotary embeddings use the rotate-half convention for the same
reason. Attention is delegated to a pluggable backend (local, Ulysses, Untied Ulysses)
that takes the normed hidden states and the raw q/k/v weights; the memory techniques
(checkpointing, offload, tiling) are switched on per block by `parallelize`.

Shapes: a micro-batch is [B, S_local] tokens (S_local = S / cp on a context-parallel
rank); `position_ids` are global positions; `cu_seqlens` are the causal segments of the
flattened global batch (B * S tokens), as Python ints.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lc.attention.kernel_selection import select_kernel
from megatron_lc.attention.local import LocalAttention
from megatron_lc.attention.rotary import RopeScaling, rope_cos_sin, rope_inv_freq
from megatron_lc.memory.kept_attention import KeptAttention, KeptTensor
from megatron_lc.memory.tiling import (
    TileBounds,
    linear_cross_entropy,
    tile_bounds,
    tiled_linear_cross_entropy,
    tiled_swiglu_mlp,
)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA model."""

    vocab_size: int
    """Rows of the embedding and output matrices."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Transformer blocks."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (grouped-query attention); equal to the query heads for plain MHA."""
    kv_channels: int
    """Head dimension; independent of hidden_size / heads."""
    ffn_hidden_size: int
    """Width of the SwiGLU MLP."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rotary_base: float = 500000.0
    """Rotary theta."""
    rope_scaling: RopeScaling | None = None
    """Rotary scaling (llama3, linear or yarn), or None for plain rotary."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output projection."""
    max_position_embeddings: int = 131072
    """Recorded in exported configs; rotary itself works at any length."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every matrix."""

    def validate(self) -> None:
        """Reject shapes that cannot work, naming the value."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                     "kv_channels", "ffn_hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_query_groups ({self.num_query_groups})")
        if self.kv_channels % 2:
            raise ValueError(f"kv_channels must be even for rotary embeddings, got {self.kv_channels}")
        if self.rope_scaling is not None:
            self.rope_scaling.validate()


# --- attention ----------------------------------------------------------------------------


class AttentionBackend(Protocol):
    """Normed local hidden states and raw projection weights in, pre-`o_proj` output out.

    A backend may take more of the layer (see `Attention.forward`): with `projects_output` it also
    takes `wo=` and returns the projected output; with `fuses_input_norm` it takes the un-normed
    input and `norm_weight=`, `norm_eps=` as well."""

    def __call__(self, x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: tuple[int, ...],
                 kept: KeptAttention | None = None) -> torch.Tensor:
        """x [B, S_local, hidden], cos/sin [B, S_local, d] -> [B, S_local, heads * d]. `kept`: the block's kept
        attention store, handed to the attention op (`memory/kept_attention.py`; None: it computes as usual)."""
        ...

    def kept_tensors(self, batch: int, tokens: int, num_heads: int, dtype: torch.dtype) -> list[KeptTensor]:
        """What the attention op of a keeping block puts on the host for `batch` samples of `tokens` local tokens
        computed in `dtype` (the memory stack makes their arenas before step 1)."""
        ...


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, h, kv = config.kv_channels, config.num_attention_heads, config.num_query_groups
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)
        self.backend: AttentionBackend = LocalAttention(d, select_kernel(torch.device("cpu")))

    def forward(self, x, cos, sin, cu_seqlens, norm: "RMSNorm | None" = None, kept: KeptAttention | None = None):
        """Attention of x, or with `norm` of norm(x). A backend may take more of the layer to save memory
        in backward: o_proj's weight (`projects_output`), the norm too (`fuses_input_norm`). `kept`: the
        block's kept attention store, passed to the backend."""
        weights, backend = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight), self.backend
        if norm is not None and getattr(backend, "fuses_input_norm", False):
            return backend(x, *weights, cos, sin, cu_seqlens, kept, wo=self.o_proj.weight, norm_weight=norm.weight,
                           norm_eps=norm.eps)
        x = norm(x) if norm is not None else x
        if getattr(backend, "projects_output", False):
            return backend(x, *weights, cos, sin, cu_seqlens, kept, wo=self.o_proj.weight)
        return self.o_proj(backend(x, *weights, cos, sin, cu_seqlens, kept))


# --- MLP and block ------------------------------------------------------------------------


class MLP(nn.Module):
    """SwiGLU; tiled over the sequence when `num_tiles` is set."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)
        self.num_tiles: int | None = None
        self.tile_bounds: TileBounds = tile_bounds
        """The tile policy of the tiled MLP (the planner's runs representative tiles)."""
        self.fp32_out_gemm: bool | None = None
        """How the tiles' fp32 weight-gradient sums are taken (`tiling.addmm_fp32_`); set with the tiles."""

    def forward(self, x):
        if self.num_tiles:
            return tiled_swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                                    self.num_tiles, self.tile_bounds, self.fp32_out_gemm)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


RMSNormOp = Callable[..., torch.Tensor]
"""`F.rms_norm`'s signature: (input, normalized_shape, weight, eps) -> output."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.op: RMSNormOp = F.rms_norm
        """The norm's op (the planner's stand-in allocates as torch's fused CUDA kernel)."""

    def forward(self, x):
        # One fused op: no fp32 copy of x is kept for backward (at 5M tokens that copy is the
        # largest buffer of a recomputed block). Equal to transformers' norm in fp32; in bf16
        # it rounds once where transformers rounds twice.
        return self.op(x, (x.shape[-1],), self.weight, self.eps)


@dataclass
class BlockMemory:
    """How one block saves memory; set by `parallelize`, identical on every rank."""

    recompute: str = "none"
    """none | full (keep only the block input) | selective (keep attention, recompute the MLP half)."""
    offload: object | None = None
    """An OffloadScheduler for the kept block inputs (full recompute only)."""
    kept_attention: KeptAttention | None = None
    """Full recompute: the block's store of its attention output and lse (with the input: on the host when
    offloaded), so the recompute does not run the attention forward kernel again (--keep-attention-output);
    handed to the checkpoint wrapper and the attention op. None: the block keeps none."""

    @property
    def keep_attention(self) -> bool:
        """Whether the block keeps its attention output and lse."""
        return self.kept_attention is not None


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)
        self.memory = BlockMemory()

    def forward(self, x, cos, sin, cu_seqlens):
        if self.memory.recompute == "full":
            from megatron_lc.memory.recompute import checkpoint_residual_block

            # A block's output feeds only the next block or the head: its gradient is this block's alone.
            return checkpoint_residual_block((lambda t: self._attention_branch(t, cos, sin, cu_seqlens),
                                              self._mlp_branch), x, offload=self.memory.offload,
                                             layer_idx=self.layer_idx, owns_output_grad=True,
                                             replay_params=self.gathered_parameters,
                                             kept=self.memory.kept_attention)
        return self._forward(x, cos, sin, cu_seqlens)

    @contextlib.contextmanager
    def gathered_parameters(self, keep: bool = False):
        """The block's full parameters outside its own forward (sparse offload runs it again in a later
        block's backward): under FSDP2, gathered for the context and sharded again after unless `keep`."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        sharded = isinstance(self, FSDPModule) and any(isinstance(p, DTensor) for p in self.parameters())
        if sharded:
            self.unshard()
        try:
            yield
        finally:
            if sharded and not keep:
                self.reshard()

    def _attention_branch(self, x, cos, sin, cu_seqlens):
        return self.self_attn(x, cos, sin, cu_seqlens, norm=self.input_layernorm, kept=self.memory.kept_attention)

    def _mlp_branch(self, h):
        return self.mlp(self.post_attention_layernorm(h))

    def _forward(self, x, cos, sin, cu_seqlens):
        h = x + self._attention_branch(x, cos, sin, cu_seqlens)
        if self.memory.recompute == "selective":
            from megatron_lc.memory.recompute import checkpoint_block

            return checkpoint_block(self._mlp_residual, h)
        return self._mlp_residual(h)

    def _mlp_residual(self, h):
        return h + self._mlp_branch(h)


# --- output head and loss -------------------------------------------------------------------


class LMHead(nn.Module):
    """Final norm, output projection and the loss, as one module (one FSDP unit)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.loss_tiles: int | None = None
        self.tile_bounds: TileBounds = tile_bounds
        """The tile policy of the tiled loss."""
        self.fp32_out_gemm: bool | None = None
        """How the tiled loss sums its weight gradient in fp32 (`tiling.addmm_fp32_`); set with the tiles."""

    def forward(self, h, labels=None, per_token: bool | str = False):
        """Logits [B, S, V] without labels; else (sum of token losses, valid-token count),
        or with `per_token` (evaluation, no grad) each token's loss [B, S] (0 where ignored); with
        `per_token="greedy"` also whether each label is the logits' argmax [B, S] (greedy decoding's choice)."""
        h = self.norm(h)
        if labels is None:
            return self.lm_head(h)
        if per_token:
            return self._token_losses(h, labels, greedy=per_token == "greedy")
        flat_h, flat_labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
        if self.loss_tiles:
            return tiled_linear_cross_entropy(flat_h, self.lm_head.weight, flat_labels, self.loss_tiles,
                                              bounds=self.tile_bounds, fp32_out_gemm=self.fp32_out_gemm)
        return linear_cross_entropy(flat_h, self.lm_head.weight, flat_labels)

    @torch.no_grad()
    def _token_losses(self, h, labels, rows_per_tile: int = 4096, greedy: bool = False):
        """Per-token cross-entropy (and with `greedy` argmax hits), a tile of rows at a time (never the full
        logits)."""
        flat_h, flat_labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
        out = torch.zeros(flat_labels.shape, dtype=torch.float32, device=h.device)
        hits = torch.zeros(flat_labels.shape, dtype=torch.bool, device=h.device)
        for a in range(0, flat_h.shape[0], rows_per_tile):
            logits = self.lm_head(flat_h[a:a + rows_per_tile]).float()
            out[a:a + rows_per_tile] = F.cross_entropy(logits, flat_labels[a:a + rows_per_tile], reduction="none",
                                                       ignore_index=-100)
            if greedy:
                hits[a:a + rows_per_tile] = logits.argmax(-1) == flat_labels[a:a + rows_per_tile]
        return (out.view(labels.shape), hits.view(labels.shape)) if greedy else out.view(labels.shape)


# --- the model ------------------------------------------------------------------------------


class Transformer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_layers))
        self.head = LMHead(config)
        self.sample_length: int | None = None
        """Tokens per sample the model is run on (set by the parallelize step; None: each input's whole length):
        what dynamic NTK scaling scales by, whichever slice of it a context-parallel rank holds."""
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection; redone after `to_empty`, which unties."""
        if self.config.tie_embeddings:
            self.head.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, position_ids=None, labels=None, cu_seqlens=None, per_token: bool = False):
        """Logits without labels; with labels, (loss_sum, num_valid) over the local tokens
        (or per-token losses with `per_token`, for evaluation)."""
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        if cu_seqlens is None:
            cu_seqlens = tuple(range(0, B * S + 1, S))
        h = self.embed_tokens(input_ids)
        c = self.config
        inv_freq = rope_inv_freq(c.kv_channels, c.rotary_base, c.rope_scaling, h.device,
                                 self.sample_length or S, c.max_position_embeddings)
        cos, sin = rope_cos_sin(position_ids, inv_freq, h.dtype, c.rope_scaling.cos_sin_factor() if c.rope_scaling else 1.0)
        for layer in self.layers:
            h = layer(h, cos, sin, tuple(cu_seqlens))
        return self.head(h, labels, per_token)

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        for layer in self.layers:
            layer.self_attn.backend = backend

    def initial_value(self, name: str, shape, device, generator: torch.Generator) -> torch.Tensor:
        """The initial (full) value of parameter `name`: unit norms, Normal(0, init_std) matrices."""
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=device)
        return torch.empty(shape, device=device).normal_(0.0, self.config.init_std, generator=generator)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter from (seed, its name): the same weights on any layout."""
        for name, param in self.named_parameters():
            generator = torch.Generator(device=param.device).manual_seed(parameter_seed(seed, name))
            param.copy_(self.initial_value(name, param.shape, param.device, generator))


def parameter_seed(seed: int, name: str) -> int:
    """A per-parameter seed, stable across runs and processes."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def build_model(config: LlamaConfig, device: torch.device | str = "meta", dtype=torch.float32,
                seed: int | None = 0) -> Transformer:
    """A model on `device`; on a real device it is initialised (seeded), on meta left empty."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to(dtype=dtype)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.tie_weights()
    if seed is not None:
        model.init_weights(seed)
    return model


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once); works on meta."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
