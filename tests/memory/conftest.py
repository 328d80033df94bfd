"""Shared settings for the memory-technique tests: one thread, fixed seed."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_fixed_seed():
    """Keep the shared machine responsive and the inputs reproducible."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
