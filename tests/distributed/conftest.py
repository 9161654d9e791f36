"""Guards for the multi-process tests: a hung collective must fail the run, not stall it."""

from __future__ import annotations

import faulthandler
import sys

import pytest

HANG_TIMEOUT_S = 600.0  # generous: worker start-up is slow on a loaded 2-core machine


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(HANG_TIMEOUT_S, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()
