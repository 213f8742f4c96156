"""``python -m services.leaderboard``: serve the leaderboard with uvicorn (settings from env)."""

from __future__ import annotations

import uvicorn

from services.leaderboard.app import create_app
from services.leaderboard.settings import LeaderboardSettings
from services.logs import configure


def main() -> None:
    configure()
    settings = LeaderboardSettings()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        # Faster HTTP parsing and event loop when installed (they are dependencies).
        http="auto",
        loop="auto",
        timeout_graceful_shutdown=10,
    )


if __name__ == "__main__":
    main()
