"""``python -m services.leaderboard``: serve the leaderboard with uvicorn (settings from env;
slow and idle clients bounded by services.http_server)."""

from __future__ import annotations

from services.http_server import serve
from services.leaderboard.app import create_app
from services.leaderboard.settings import LeaderboardSettings
from services.logs import configure


def main() -> None:
    configure()
    settings = LeaderboardSettings()
    serve(
        create_app(settings),
        settings,
        log_level="warning",
        access_log=False,
        # Faster HTTP parsing and event loop when installed (they are dependencies).
        loop="auto",
        timeout_graceful_shutdown=10,
        stop_limit_s=40.0,  # its requests 10 s, then Redis closed and the process gone
    )


if __name__ == "__main__":
    main()
