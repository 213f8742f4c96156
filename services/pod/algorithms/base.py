"""What the built-in off-policy agents declare for the registry (services/pod/trainer.py's
``Algorithm``): they train one agent per pod with services/pod/offpolicy.py's trainer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from services.pod.algorithms.hyperparameters import HyperparameterError

if TYPE_CHECKING:
    from services.pod.trainer import Trainer


class OffPolicyAlgorithm:
    name: ClassVar[str]

    def end_episodes(self, done: Any) -> None:
        """The episodes of the sub-environments where ``done`` (a bool tensor) ended; an
        agent whose exploration has a state over time (services/pod/algorithms/noise.py)
        starts it over there."""

    @classmethod
    def trainer(cls, slots: int) -> type[Trainer]:
        one_agent_per_pod(cls.name, slots)
        # Imported here: the trainer imports the algorithms' shared machinery, not this.
        from services.pod.offpolicy import offpolicy_trainer

        return offpolicy_trainer(cls.name)


def one_agent_per_pod(algorithm: str, slots: int) -> None:
    """Refuse a population pod (``slots`` > 1) for an algorithm that trains one agent a pod."""
    if slots != 1:
        raise HyperparameterError(
            f"{algorithm} trains one agent per pod: population pods "
            f"(population.agents_per_pod > 1) train PPO only"
        )
