"""TD3: twin critics, delayed policy updates, target smoothing; continuous actions."""

from services.contracts.algorithms.card import PopulationCard
from services.contracts.algorithms.offpolicy import off_policy_card
from services.contracts.algorithms.td3.config import TD3Config

# Its card (services/contracts/algorithms/card.py): the off-policy family's, with a population:
# the fields that enter a population's update as per-agent (P,) tensors
# (services/pod/algorithms/stacked.py); the rest the agents share.
CARD = off_policy_card(
    "td3",
    "TD3",
    TD3Config,
    ("continuous",),
    __name__,
    summary=__doc__ or "",
    population=PopulationCard(
        hyperparameters=(
            "learning_rate",
            "gamma",
            "tau",
            "exploration_noise",
            "policy_noise",
            "noise_clip",
        ),
    ),
)
