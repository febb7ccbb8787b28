"""Collects the fault suite's trials and writes its summary table at the end of the session.

Each test of ``test_injected_faults.py`` hands its trials to the ``fault_trials``
list; when the session ends the table is written as JSON (``HIPRESS_FAULTS_JSON``,
default ``results/faults.json``) and printed in pytest's terminal summary.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

_TRIALS = []
_WRITTEN = []


@pytest.fixture
def fault_trials():
    """The session's list of ``harness.Trial``; append every trial run."""
    return _TRIALS


def pytest_sessionfinish(session, exitstatus):
    if _TRIALS:
        _WRITTEN.append(harness.write_summary(_TRIALS))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _TRIALS:
        terminalreporter.section("fault-injection summary")
        terminalreporter.write_line(harness.render(harness.summarize(_TRIALS)))
        if _WRITTEN:
            terminalreporter.write_line(f"written to {_WRITTEN[-1]}")
