"""Model zoo. `python -m megatron_lc.models --list` prints every flavour and its size."""
