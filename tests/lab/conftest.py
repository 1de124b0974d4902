"""The share of the checkers' rejections that name the mistake (issue #50: at least 70%), counted over every wrong
answer the tests in this folder feed the checkers (tests/learner.py's ``fails_with``), and printed at the end of the
run. ``K2LAB_NAMING_REPORT=path.json`` also writes each rejection with its verdict."""

from __future__ import annotations

import json
import os

import pytest
from learner import REJECTED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for corpus, verdicts in REJECTED.items():
        if verdicts:
            named = sum(v.mistake is not None for v in verdicts)
            terminalreporter.write_line(f"checkers, {corpus}: {len(verdicts)} wrong answers rejected, {named} with "
                                        f"the mistake named ({named / len(verdicts):.0%})")
    path = os.environ.get("K2LAB_NAMING_REPORT")
    if path:
        rows = [{"corpus": corpus, "named": v.mistake is not None, "message": v.message}
                for corpus, verdicts in REJECTED.items() for v in verdicts]
        with open(path, "w") as out:
            json.dump(rows, out, indent=1, ensure_ascii=False)
