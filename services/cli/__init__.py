"""The ``podium`` command line (``app``): commands in app.py parse and delegate to the modules
beside it. Only the CLI uses this package; the services never import it."""

from services.cli.app import app

__all__ = ["app"]
