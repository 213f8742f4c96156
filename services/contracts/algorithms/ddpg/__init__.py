"""DDPG: deterministic policy gradient with action noise; continuous actions."""

from services.contracts.algorithms.card import PopulationCard
from services.contracts.algorithms.ddpg.config import DDPGConfig
from services.contracts.algorithms.offpolicy import off_policy_card

# Its card (services/contracts/algorithms/card.py): the off-policy family's, with a population:
# the fields that enter a population's update as per-agent (P,) tensors
# (services/pod/algorithms/stacked.py); the rest the agents share.
CARD = off_policy_card(
    "ddpg",
    "DDPG",
    DDPGConfig,
    ("continuous",),
    __name__,
    summary=__doc__ or "",
    population=PopulationCard(
        hyperparameters=("learning_rate", "gamma", "tau", "exploration_noise"),
    ),
)
