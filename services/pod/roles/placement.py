"""Where a trainer's roles run: the interface every placement of worker and evaluator has
(in the learner's process, where the trainers run them themselves; apart, as processes or
containers, services/pod/roles/multiprocess.py)."""

from __future__ import annotations

from typing import Protocol

from services.logs import get_logger

log = get_logger(__name__)


class Roles(Protocol):
    """Where a trainer's worker and evaluator run: in the trainer's process (``in_process``)
    or apart (services/pod/roles/multiprocess.py). A trainer that cannot use roles apart trains in
    its own process and closes them, so that their processes or containers exit."""

    in_process: bool

    def close(self) -> None: ...


def train_in_process(roles: Roles | None, why: str, **fields: object) -> None:
    """For a trainer that cannot use roles apart: when ``roles`` were started apart, say
    ``why`` (a warning) and close them, so that their processes or containers exit."""
    if roles is not None and not roles.in_process:
        log.warning(why, asked=type(roles).__name__, **fields)
        roles.close()
