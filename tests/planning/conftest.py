"""Planner tests trace in this process and remember nothing between runs: a test sees its own traces only."""

import pytest


@pytest.fixture(autouse=True)
def _planner_traces_here(monkeypatch):
    monkeypatch.setenv("MEGATRON_LC_PLAN_CACHE", "off")
    monkeypatch.setattr("megatron_lc.planning.estimate_pool.default_workers", lambda: 1)
