"""``python -m services.orchestrator``: serve the experiments API and run the reconciler."""

from __future__ import annotations

from services.http_server import serve
from services.logs import configure
from services.orchestrator.app import create_app
from services.orchestrator.settings import OrchestratorSettings


def main() -> None:
    configure()
    settings = OrchestratorSettings()
    serve(create_app(settings), settings)  # uvicorn with the slow-client limits (http_server)


if __name__ == "__main__":
    main()
