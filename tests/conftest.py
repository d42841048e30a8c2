"""Every scheduler the tests start checks the core's invariants after each step and exits loudly
(code 70, the violation in its log) when one breaks; see scheduler_svc/invariants.py.

`hang_guard`: a test that uses it and runs past HANG_SECONDS (or its `hang_seconds(n)` mark)
dumps every thread's traceback and ends the test run (exit 1) instead of hanging it; the stack's
processes die with their parent.
"""

from __future__ import annotations

import faulthandler
import os

import pytest

from scheduler_svc.invariants import ENV_VAR

os.environ.setdefault(ENV_VAR, "1")
HANG_SECONDS = 300


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "hang_seconds(n): hang_guard's limit for this test")


@pytest.fixture
def hang_guard(request):
    mark = request.node.get_closest_marker("hang_seconds")
    faulthandler.dump_traceback_later(mark.args[0] if mark else HANG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
