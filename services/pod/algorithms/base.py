"""What the built-in off-policy agents share (services/pod/training/trainer.py's ``Algorithm``):
the off-policy trainer (services/pod/training/offpolicy.py) builds and steps them."""

from __future__ import annotations

from typing import Any, ClassVar


class OffPolicyAlgorithm:
    name: ClassVar[str]

    def end_episodes(self, done: Any) -> None:
        """The episodes of the sub-environments where ``done`` (bool) ended: an agent whose
        exploration has a state over time (services/pod/algorithms/noise.py) restarts it."""
