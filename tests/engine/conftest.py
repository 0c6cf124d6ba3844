"""Fixtures of the scheduler tests (sched_harness.py)."""
from __future__ import annotations

import pytest
from sched_harness import SchedulerFactory


@pytest.fixture
def make():
    """Builds schedulers (`make(**SchedulerConfig fields)`); at teardown checks that each
    one's KV pool is whole at idle."""
    factory = SchedulerFactory()
    yield factory
    factory.check_idle()
