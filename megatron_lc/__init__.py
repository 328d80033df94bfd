"""megatron_lc: Megatron-style, PyTorch-native training of LLaMA models on million-token contexts."""

__version__ = "0.1.0"
