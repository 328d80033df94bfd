from megatron_lc.models.llama.model import LlamaConfig, RopeScaling, Transformer, build_model, count_parameters
from megatron_lc.models.llama.zoo import FLAVOURS, get_config

__all__ = ["LlamaConfig", "RopeScaling", "Transformer", "build_model", "count_parameters", "FLAVOURS", "get_config"]
