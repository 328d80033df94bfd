"""Memory planner: per-GPU and host memory of a configuration, traced from one real step on fake tensors.

    from megatron_lc.planning import Machine, estimate, find_max_seq_length, ablate

See docs/memory_planner.md and tools/estimate_memory.py.
"""

from megatron_lc.planning.estimate import Estimate, Machine, estimate
from megatron_lc.planning.search import SearchResult, ablate, find_max_seq_length

__all__ = ["Estimate", "Machine", "SearchResult", "ablate", "estimate", "find_max_seq_length"]
