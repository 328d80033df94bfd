"""Settings every test shares, and the markers of the slow tier (`tests/tiers.py`), set from what each test uses.

`make test` runs everything; `make test-fast` leaves out the tests marked `multiprocess` (they start other
processes: gloo worlds, torchrun, a tool's command line) or `planner_trace` (they trace a step with the memory
planner). A new test is marked by what it calls, with nothing to remember; `-m multiprocess` runs one tier.
"""

import pytest
import torch

from tests.tiers import MARKERS, tier_markers

# Tests share two cores with the multi-process runs they start.
torch.set_num_threads(1)


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in tier_markers(item):
            item.add_marker(getattr(pytest.mark, name))


@pytest.fixture(autouse=True)
def _library_log_left_as_found():
    """A training run in the test's process shows the package's INFO lines on stdout for the rest of that process
    (`training.logging.show_library_log`, once per process as the entry points want); a later test reading stdout
    (the planner's --json) must not see them."""
    import logging

    logger = logging.getLogger("megatron_lc")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
