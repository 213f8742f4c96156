"""The CLI's exit codes (documented in docs/tournaments.md) and its one error type: every
failure a user can act on is a ``CliError`` whose message is printed on one line (no
traceback) and whose ``exit_code`` the command exits with."""

from __future__ import annotations

EXIT_OK = 0
EXIT_NOT_REACHED = 1  # the experiment ended without reaching its target / --min-reward
EXIT_USAGE = 2  # bad input: spec file, config file, options
EXIT_API = 3  # unreachable service, refused token, unexpected answer, platform failed
EXIT_TIMEOUT = 4  # --timeout passed while waiting
EXIT_INTERRUPTED = 130  # Ctrl-C


class CliError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_USAGE, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.status = status
