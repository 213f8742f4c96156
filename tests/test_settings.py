"""Shared service settings: the API token."""

from __future__ import annotations

import pytest

from services.settings import PodiumSettings


def test_no_token_means_open_api():
    assert PodiumSettings(api_token=None).token() is None


def test_token_from_value_and_file(tmp_path):
    assert PodiumSettings(api_token="s3cret").token() == "s3cret"
    path = tmp_path / "token"
    path.write_text("from-secret\n")
    assert PodiumSettings(api_token_file=path).token() == "from-secret"


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_token_is_an_error_not_an_open_api(tmp_path, value):
    with pytest.raises(ValueError, match="empty"):
        PodiumSettings(api_token=value).token()
    path = tmp_path / "token"
    path.write_text(value)
    with pytest.raises(ValueError, match="empty"):
        PodiumSettings(api_token_file=path).token()


@pytest.mark.parametrize("grace", [0.0, 0.5, 30.0])
def test_every_grace_period_the_orchestrator_takes_its_pods_take(monkeypatch, grace):
    """The orchestrator hands its termination grace to each pod (PODIUM_TERMINATION_GRACE_S):
    a value it accepts (0 included, as the chart's schema) must not make every pod exit 2."""
    from services.orchestrator.settings import OrchestratorSettings
    from services.pod.__main__ import PodSettings

    settings = OrchestratorSettings(termination_grace_s=grace)
    monkeypatch.setenv("PODIUM_TERMINATION_GRACE_S", f"{settings.termination_grace_s:g}")
    assert PodSettings(spec="{}", leaderboard_url="http://lb").termination_grace_s == grace
