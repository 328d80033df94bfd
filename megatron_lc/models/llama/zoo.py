"""Named model shapes (flavours), selected with `--model NAME`."""

from __future__ import annotations

from dataclasses import replace

from megatron_lc.models.llama.model import LlamaConfig, RopeScaling

LLAMA3_VOCAB = 128256

FLAVOURS: dict[str, LlamaConfig] = {
    # Tiny shapes for tests and the CPU demo; GQA so grouped paths are always exercised.
    "debug": LlamaConfig(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=8,
                         num_query_groups=2, kv_channels=16, ffn_hidden_size=192, rotary_base=10000.0),
    "debug-tied": LlamaConfig(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=8,
                              num_query_groups=2, kv_channels=16, ffn_hidden_size=192,
                              rotary_base=10000.0, tie_embeddings=True),
    # Llama 3.2 3B.
    "llama3-3b": LlamaConfig(vocab_size=LLAMA3_VOCAB, hidden_size=3072, num_layers=28, num_attention_heads=24,
                             num_query_groups=8, kv_channels=128, ffn_hidden_size=8192,
                             rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True),
    # Llama 3.1 8B.
    "llama3-8b": LlamaConfig(vocab_size=LLAMA3_VOCAB, hidden_size=4096, num_layers=32, num_attention_heads=32,
                             num_query_groups=8, kv_channels=128, ffn_hidden_size=14336,
                             rope_scaling=RopeScaling(factor=8.0)),
    # The 32B shape used in the Untied Ulysses evaluation.
    "llama-32b": LlamaConfig(vocab_size=LLAMA3_VOCAB, hidden_size=5120, num_layers=64, num_attention_heads=64,
                             num_query_groups=8, kv_channels=128, ffn_hidden_size=25600),
}


def get_config(name: str, base: LlamaConfig | None = None, **overrides) -> LlamaConfig:
    """The flavour `name` (or `base`, e.g. a checkpoint's config) with Megatron-style overrides (None values
    ignored), validated."""
    if base is None and name not in FLAVOURS:
        raise ValueError(f"--model {name!r}: unknown flavour; expected one of {', '.join(FLAVOURS)}")
    base = base or FLAVOURS[name]
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.keys() & {"hidden_size", "num_attention_heads"} and "kv_channels" not in given:
        shaped = replace(base, **given)  # as Megatron: head dimension = hidden size / heads
        given["kv_channels"] = shaped.hidden_size // shaped.num_attention_heads
    config = replace(base, **given)
    config.validate()
    return config


def config_from_dict(values: dict) -> LlamaConfig:
    """A LlamaConfig from its `dataclasses.asdict` form (as a checkpoint's meta.json records it)."""
    values = dict(values)
    if values.get("rope_scaling"):
        values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
    return LlamaConfig(**values)


def rope_scaling_from_flags(base: RopeScaling | None, use_rope_scaling: bool,
                            factor: float | None) -> RopeScaling | None:
    """--use-rope-scaling turns Llama 3.x scaling on (factor 8 as Megatron-LM unless --rope-scaling-factor);
    --rope-scaling-factor alone changes the factor of a flavour that scales."""
    if base is None and not use_rope_scaling:
        return None
    base = base or RopeScaling()
    return replace(base, factor=factor) if factor is not None else base
