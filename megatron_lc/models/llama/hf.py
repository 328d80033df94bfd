"""Conversion of configs and weights to and from `transformers`' LlamaForCausalLM.

Our parameter names are transformers' names without the `model.` prefix, except the
final norm and output projection which live in `head.` (one module, one FSDP unit).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lc.models.llama.model import LlamaConfig, RopeScaling


def _require_transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("Hugging Face conversion needs transformers: pip install 'megatron_lc[hf]'") from e
    return transformers


HF_ROPE_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"),
    "dynamic": ("factor",),
}
"""transformers' keys of each rope type we compute (yarn's last three optional there)."""


def hf_rope_scaling(config: LlamaConfig) -> dict | None:
    """The model's rope scaling as transformers' `rope_scaling` dict (None without scaling)."""
    s = config.rope_scaling
    if s is None:
        return None
    values = {key: getattr(s, key) for key in HF_ROPE_KEYS[s.rope_type]}
    return {"rope_type": s.rope_type, **{k: v for k, v in values.items() if v is not None}}


def rope_scaling_from_hf(scaling: dict, max_position_embeddings: int) -> RopeScaling:
    """Our RopeScaling from transformers' dict (checked by `check_hf_config`)."""
    kind = scaling.get("rope_type", scaling.get("type"))
    values = {k: scaling[k] for k in HF_ROPE_KEYS[kind] if scaling.get(k) is not None}
    if kind == "yarn" and "original_max_position_embeddings" not in values:  # transformers' fallback
        values["original_max_position_embeddings"] = max_position_embeddings
    if kind == "yarn" and "factor" not in values:
        values["factor"] = max_position_embeddings / values["original_max_position_embeddings"]
    return RopeScaling(rope_type=kind, **values)


def to_hf_config(config: LlamaConfig, **extra: Any):
    """A transformers.LlamaConfig with the same shape."""
    transformers = _require_transformers()
    rope_scaling = hf_rope_scaling(config)
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels, rms_norm_eps=config.norm_eps,
        rope_theta=config.rotary_base, rope_scaling=rope_scaling, tie_word_embeddings=config.tie_embeddings,
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.init_std,
        attention_bias=False, mlp_bias=False, **extra,
    )


def _hf_rope(hf_config) -> tuple[float, dict | None]:
    """(theta, scaling dict) from either the rope_parameters (v5) or rope_scaling (v4) layout."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return theta, params if params.get("rope_type", "default") != "default" else None
    return getattr(hf_config, "rope_theta", 10000.0), getattr(hf_config, "rope_scaling", None)


class UnsupportedHFConfig(ValueError):
    """A transformers config field whose value this model does not compute: one line naming field and value."""


def _refuse(field: str, value: Any, why: str) -> UnsupportedHFConfig:
    return UnsupportedHFConfig(f"{field}={value!r}: {why}")


# Fields of transformers' LlamaConfig that change nothing this model computes from the weights:
# token ids, caching, and pretraining_tp (it split the same matmuls in transformers < 4.45, which
# is the same function; transformers 5 ignores it). initializer_range and max_position_embeddings
# are recorded (as init_std and max_position_embeddings).
ACCEPTED_ANY_VALUE = ("pretraining_tp", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id")


def check_hf_config(hf_config) -> None:
    """Refuse every field whose value would make our model compute something else than transformers'."""
    model_type = getattr(hf_config, "model_type", "llama")
    if model_type != "llama":
        raise _refuse("model_type", model_type, "expected a llama config")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "the MLP is SwiGLU, which needs 'silu'")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, field, False):
            raise _refuse(field, True, "the projections have no biases")
    dropout = getattr(hf_config, "attention_dropout", 0.0) or 0.0
    if dropout != 0:
        raise _refuse("attention_dropout", dropout, "attention has no dropout (training would differ)")
    heads = hf_config.num_attention_heads
    if (getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads) % 2:
        raise _refuse("head_dim", hf_config.head_dim, "rotary embeddings need an even head dimension")
    _, scaling = _hf_rope(hf_config)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in HF_ROPE_KEYS:
            raise _refuse("rope_scaling.rope_type", kind, "only 'default', 'llama3', 'linear', 'yarn' and 'dynamic' "
                          "rotary embeddings are implemented")
        required = {"llama3": HF_ROPE_KEYS["llama3"], "linear": ("factor",), "yarn": (), "dynamic": ("factor",)}[kind]
        missing = [k for k in required if k not in scaling]
        if missing:
            raise _refuse("rope_scaling", scaling, f"{kind} scaling without {', '.join(missing)}")
        extra = set(scaling) - {"rope_type", "type", "rope_theta", *HF_ROPE_KEYS[kind]} - (
            {"truncate"} if scaling.get("truncate", True) is True else set())
        if extra:
            raise _refuse("rope_scaling", scaling, f"keys this model does not compute: {', '.join(sorted(extra))}")


def from_hf_config(hf_config) -> LlamaConfig:
    """Our LlamaConfig from a transformers config; a field we do not compute exactly is refused (see check_hf_config)."""
    check_hf_config(hf_config)
    theta, scaling = _hf_rope(hf_config)
    rope = None if scaling is None else rope_scaling_from_hf(scaling, hf_config.max_position_embeddings)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    config = LlamaConfig(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size, num_layers=hf_config.num_hidden_layers,
        num_attention_heads=heads, num_query_groups=hf_config.num_key_value_heads or heads, kv_channels=head_dim,
        ffn_hidden_size=hf_config.intermediate_size, norm_eps=hf_config.rms_norm_eps, rotary_base=float(theta),
        rope_scaling=rope, tie_embeddings=bool(hf_config.tie_word_embeddings),
        max_position_embeddings=hf_config.max_position_embeddings, init_std=hf_config.initializer_range,
    )
    try:
        config.validate()
    except ValueError as e:
        raise UnsupportedHFConfig(str(e)) from e
    return config


def to_hf_name(name: str) -> str:
    """Our parameter name -> transformers' name."""
    if name.startswith("head.lm_head."):
        return name.removeprefix("head.")
    if name.startswith("head.norm."):
        return "model." + name.removeprefix("head.")
    return "model." + name


def from_hf_name(name: str) -> str:
    """transformers' parameter name -> ours."""
    if name.startswith("lm_head."):
        return "head." + name
    if name.startswith("model.norm."):
        return "head." + name.removeprefix("model.")
    if name.startswith("model."):
        return name.removeprefix("model.")
    raise ValueError(f"unexpected parameter {name!r} in a LlamaForCausalLM state dict")


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our full state dict -> transformers' (a tied output weight appears under both names, as in theirs)."""
    out = {to_hf_name(k): v for k, v in state_dict.items()}
    if config.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(hf_state_dict: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """transformers' state dict -> ours (rotary buffers dropped, tied weight restored)."""
    out = {from_hf_name(k): v for k, v in hf_state_dict.items() if "rotary_emb" not in k}
    if config.tie_embeddings:
        out["head.lm_head.weight"] = out["embed_tokens.weight"]
    return out
