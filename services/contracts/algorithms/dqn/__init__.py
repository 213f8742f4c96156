"""The DQN family (double, dueling): off-policy, discrete actions."""

from services.contracts.algorithms.dqn.config import DQNConfig
from services.contracts.algorithms.offpolicy import off_policy_card

# Its card (services/contracts/algorithms/card.py): the off-policy family's, one agent a pod.
CARD = off_policy_card("dqn", "DQN", DQNConfig, ("discrete",), __name__, summary=__doc__ or "")
