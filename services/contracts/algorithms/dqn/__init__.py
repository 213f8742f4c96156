"""The DQN family (double, dueling): off-policy, discrete actions."""

from services.contracts.algorithms.card import PopulationCard
from services.contracts.algorithms.dqn.config import DQNConfig
from services.contracts.algorithms.offpolicy import off_policy_card

# Its card (services/contracts/algorithms/card.py): the off-policy family's, with a population:
# the fields that enter a population's update or its ε-greedy acting as per-agent (P,) tensors
# (services/pod/algorithms/stacked.py); the rest (double, dueling, the networks,
# the replay, the loop) the agents share.
CARD = off_policy_card(
    "dqn",
    "DQN",
    DQNConfig,
    ("discrete",),
    __name__,
    summary=__doc__ or "",
    population=PopulationCard(
        hyperparameters=(
            "learning_rate",
            "gamma",
            "tau",
            "target_update_every",
            "max_grad_norm",
            "epsilon_start",
            "epsilon_end",
            "exploration_steps",
        ),
    ),
)
