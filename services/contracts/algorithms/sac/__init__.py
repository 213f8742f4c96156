"""SAC: Soft Actor-Critic: off-policy, maximum entropy, continuous actions."""

from services.contracts.algorithms.card import PopulationCard
from services.contracts.algorithms.offpolicy import off_policy_card
from services.contracts.algorithms.sac.config import SACConfig

# Its card (services/contracts/algorithms/card.py): the off-policy family's, with a population:
# the fields that enter a population's update as per-agent (P,) tensors or only set an agent's
# start (services/pod/algorithms/stacked.py); everything else shapes the networks,
# the replay or the loop, which the agents share.
CARD = off_policy_card(
    "sac",
    "SAC",
    SACConfig,
    ("continuous",),
    __name__,
    summary=__doc__ or "",
    population=PopulationCard(
        hyperparameters=("learning_rate", "gamma", "tau", "init_alpha", "target_entropy"),
    ),
)
