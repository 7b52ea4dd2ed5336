"""Print the "Supported models" table of docs/getting_started.md from a run of tests/test_architectures.py.

    .venv/bin/python -m tests.arch_table          # runs the matrix (~20 s), prints markdown

An architecture is "exact" only if its parity test passed, and "unsupported" only if its test that the
engine raises the expected NotImplementedError passed; anything else shows as FAILING.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.arch_configs import ARCH_CONFIGS, FEATURES, UNSUPPORTED

TEST_FILE = Path(__file__).with_name("test_architectures.py")


class _Collector:
    def __init__(self) -> None:
        self.outcomes: dict[tuple[str, str], str] = {}  # (test name, arch) -> "passed" / "failed" / ...

    def pytest_runtest_logreport(self, report) -> None:
        match = re.match(r".*::(\w+)\[(\w+)\]$", report.nodeid)
        if not match:
            return
        key = (match.group(1), match.group(2))
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[key] = report.outcome


def _model_class(arch: str) -> str:
    return (ARCH_CONFIGS[arch] if arch in ARCH_CONFIGS else UNSUPPORTED[arch])[1]


def table(outcomes: dict[tuple[str, str], str]) -> str:
    rows = ["| architecture | model class | status | exercised / reason |", "|---|---|---|---|"]
    for arch in ARCH_CONFIGS:
        ok = outcomes.get(("test_greedy_parity_with_stock_generate", arch)) == "passed"
        status = "exact greedy parity" if ok else "**FAILING**"
        rows.append(f"| {arch} | `{_model_class(arch)}` | {status} | {FEATURES.get(arch, '')} |")
    for arch, (*_, reason) in UNSUPPORTED.items():
        ok = outcomes.get(("test_unsupported_architecture_raises_clear_error", arch)) == "passed"
        status = "unsupported: clear `NotImplementedError`" if ok else "**FAILING**"
        rows.append(f"| {arch} | `{_model_class(arch)}` | {status} | {reason} |")
    return "\n".join(rows)


def main() -> int:
    collector = _Collector()
    code = pytest.main(["-q", "-p", "no:cacheprovider", str(TEST_FILE)], plugins=[collector])
    print()
    print(table(collector.outcomes))
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
