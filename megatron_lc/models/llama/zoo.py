"""Named model shapes (flavours), selected with `--model NAME`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_lc.attention.rotary import ROPE_TYPES
from megatron_lc.flags import flag
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
    # Llama 3.1 70B.
    "llama3-70b": LlamaConfig(vocab_size=LLAMA3_VOCAB, hidden_size=8192, num_layers=80, num_attention_heads=64,
                              num_query_groups=8, kv_channels=128, ffn_hidden_size=28672,
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


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """The vocabulary rounded up to a multiple of `multiple` (Megatron-LM's _vocab_size_with_padding, one
    tensor-parallel rank)."""
    return -(-vocab_size // multiple) * multiple


def config_from_dict(values: dict) -> LlamaConfig:
    """A LlamaConfig from its `dataclasses.asdict` form (as a checkpoint's meta.json records it)."""
    values = dict(values)
    if values.get("rope_scaling"):
        values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
    return LlamaConfig(**values)


ROPE_FLAGS = {"rope_type": "--rope-scaling-type", "factor": "--rope-scaling-factor",
              "original_max_position_embeddings": "--rope-scaling-original-max-position-embeddings",
              "low_freq_factor": "--rope-scaling-low-freq-factor", "high_freq_factor": "--rope-scaling-high-freq-factor",
              "beta_fast": "--rope-scaling-beta-fast", "beta_slow": "--rope-scaling-beta-slow",
              "attention_factor": "--rope-scaling-attention-factor"}
"""RopeScaling's fields by the flag that sets each."""
ROPE_FIELDS_OF = {"llama3": ("low_freq_factor", "high_freq_factor"), "linear": (),
                  "yarn": ("beta_fast", "beta_slow", "attention_factor"), "dynamic": ()}
"""The fields only one rope type reads (factor and the original positions: every type's)."""


def rope_scaling_from_flags(base: RopeScaling | None, use_rope_scaling: bool, factor: float | None,
                            **fields) -> RopeScaling | None:
    """--use-rope-scaling turns rotary scaling on (Llama 3's with factor 8, as Megatron-LM, unless
    --rope-scaling-type and --rope-scaling-factor say otherwise); the --rope-scaling-* flags change the scaling of
    a flavour or checkpoint that scales. A flag of another type's scaling, or one without any scaling, is refused
    naming it."""
    given = {k: v for k, v in {**fields, "factor": factor}.items() if v is not None}
    if base is None and not use_rope_scaling:
        if given:
            name = ROPE_FLAGS[next(iter(given))]
            raise ValueError(f"{name} sets rotary scaling, which this model does not use: add --use-rope-scaling")
        return None
    if "rope_type" in given and (base is None or given["rope_type"] != base.rope_type):
        base = RopeScaling(rope_type=given["rope_type"], **({} if base is None else {
            "factor": base.factor, "original_max_position_embeddings": base.original_max_position_embeddings}))
    scaling = replace(base or RopeScaling(), **given)
    if scaling.rope_type == "dynamic" and "original_max_position_embeddings" in given:
        raise ValueError(f"{ROPE_FLAGS['original_max_position_embeddings']} is not read by dynamic scaling, which "
                         "scales by --seq-length over --max-position-embeddings")
    for kind, names in ROPE_FIELDS_OF.items():
        for name in names:
            if name in given and kind != scaling.rope_type:
                raise ValueError(f"{ROPE_FLAGS[name]} is {kind} scaling's, not {scaling.rope_type}'s "
                                 f"(--rope-scaling-type {kind})")
    return scaling


@dataclass
class ModelArgs:
    model: str = flag("debug", "model flavour from the zoo (python -m megatron_lc.models --list)")
    num_layers: int | None = flag(None, "override: transformer blocks")
    hidden_size: int | None = flag(None, "override: width of the residual stream")
    ffn_hidden_size: int | None = flag(None, "override: width of the SwiGLU MLP")
    num_attention_heads: int | None = flag(None, "override: query heads")
    num_query_groups: int | None = flag(None, "override: key/value heads (GQA)")
    kv_channels: int | None = flag(None, "override: head dimension")
    vocab_size: int | None = flag(None, "override: vocabulary size (default: the tokenizer's, else the flavour's); "
                                        "with --tokenizer-type NullTokenizer the tokenizer's N (EOD = N, "
                                        "vocabulary N + 1)")
    rotary_base: float | None = flag(None, "override: rotary theta")
    norm_epsilon: float | None = flag(None, "override: RMSNorm epsilon")
    max_position_embeddings: int | None = flag(None, "override: positions recorded in exported configs (rotary "
                                               "itself works at any length)")
    untie_embeddings_and_output_weights: bool = flag(False, "an output matrix of its own for a flavour that ties it "
                                                     "to the embedding")
    init_method_std: float | None = flag(None, "override: standard deviation of the normal initialisation")
    use_rope_scaling: bool = flag(False, "Llama 3.x rotary scaling (factor --rope-scaling-factor, default 8)")
    rope_scaling_factor: float | None = flag(None, "rotary scaling factor (with --use-rope-scaling, or for a flavour "
                                                   "or checkpoint that scales)")
    rope_scaling_type: str | None = flag(None, "rotary scaling as transformers names it: llama3 (Llama 3.x, the "
                                         "default), linear (position interpolation), yarn (NTK-by-parts with its "
                                         "attention factor) or dynamic (NTK, the base raised by --seq-length over "
                                         "--max-position-embeddings)", choices=ROPE_TYPES)
    rope_scaling_original_max_position_embeddings: int | None = flag(
        None, "the context the base model was trained at, which the scaling stretches (default 8192, or the "
        "checkpoint's)")
    rope_scaling_low_freq_factor: float | None = flag(None, "llama3 scaling: low_freq_factor (default 1)")
    rope_scaling_high_freq_factor: float | None = flag(None, "llama3 scaling: high_freq_factor (default 4)")
    rope_scaling_beta_fast: float | None = flag(None, "yarn scaling: beta_fast (default 32)")
    rope_scaling_beta_slow: float | None = flag(None, "yarn scaling: beta_slow (default 1)")
    rope_scaling_attention_factor: float | None = flag(None, "yarn scaling: the factor on cos and sin (default "
                                                       "0.1 ln(factor) + 1)")
    make_vocab_size_divisible_by: int = flag(1, "pad the vocabulary (the tokenizer's, --vocab-size or the "
                                             "flavour's) up to a multiple of this, as Megatron-LM: the pad rows "
                                             "are embedding and output rows no token uses (Megatron-LM's default "
                                             "is 128; 1 leaves it as it is)")
    attention_dropout: float = flag(0.0, "dropout on the attention probabilities: only 0 (LLaMA trains without "
                                         "dropout; Megatron-LM's default is 0.1)")
    hidden_dropout: float = flag(0.0, "dropout on the residual branches: only 0 (LLaMA trains without dropout; "
                                      "Megatron-LM's default is 0.1)")
    checkpoint_model: dict | None = field(default=None, metadata={
        "cli": False, "help": "the whole model config of the checkpoint in --load (--use-checkpoint-args)"})
