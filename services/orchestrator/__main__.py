"""``python -m services.orchestrator``: serve the experiments API and run the reconciler."""

from __future__ import annotations

import uvicorn

from services.logs import configure
from services.orchestrator.app import create_app
from services.orchestrator.settings import OrchestratorSettings


def main() -> None:
    configure()
    settings = OrchestratorSettings()
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None)


if __name__ == "__main__":
    main()
