"""Schemathesis against both real services (`podium up`'s embedded platform: real HTTP, an
embedded Redis, the stand-in pod as pod command), seeded and bounded: every phase including the
stateful one, every check but one (see tests/schemathesis_run.py), no failure allowed.

A failure names the check and prints a curl line reproducing it. The longer run is
bench/schemathesis_long.py (results in docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli.platform import Platform
from tests import schemathesis_run
from tests.platform_servers import standin_platform

SEED = 20261123
# About 1,000-1,300 generated cases per API across the phases (at least 500 asserted), about
# 30 s for both on a 2-core machine.
MAX_EXAMPLES = 50
MIN_CASES = 500

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with standin_platform(tmp_path_factory.mktemp("schemathesis")) as p:
        yield p


@pytest.mark.parametrize("service", ["orchestrator", "leaderboard"])
def test_schemathesis_finds_nothing(platform: Platform, service: str, tmp_path: Path) -> None:
    url = platform.orchestrator_url if service == "orchestrator" else platform.leaderboard_url
    result = schemathesis_run.run(
        url, platform.token, tmp_path, max_examples=MAX_EXAMPLES, seed=SEED, timeout_s=480
    )
    phases = result.report["phases"]
    assert phases["stateful"]["status"] != "skip", phases  # links were found and followed
    assert result.cases >= MIN_CASES, result.report["test_cases"]
    assert not result.errors, result.summary()
    assert not result.failures, result.summary()
    assert platform.healthy()
