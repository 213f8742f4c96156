"""PPO's card: clipped-surrogate policy optimisation, on-policy, any action space."""

from services.contracts.algorithms.card import ON_POLICY, AlgorithmCard, PopulationCard
from services.contracts.algorithms.ppo.config import PPOConfig

CARD = AlgorithmCard(
    name="ppo",
    label="PPO",
    family=ON_POLICY,
    config=PPOConfig,
    action_kinds=("discrete", "continuous"),
    # The fields that enter the update as per-agent tensors (services/pod/algorithms/ppo.py):
    # what the agents of a population pod may differ in.
    population=PopulationCard(
        hyperparameters=(
            "learning_rate",
            "ent_coef",
            "clip_coef",
            "vf_coef",
            "gamma",
            "gae_lambda",
        ),
    ),
    # An on-policy agent explores through its own policy: replacing every pod below the leader
    # copies one policy over all of them, and overwrote the pods still exploring with idle ones
    # (MountainCar; docs/benchmarks.md, "Tournament learning quality").
    pbt_truncation=0.25,
    presets_package=__name__,
    summary="Proximal Policy Optimization (clipped surrogate, GAE)",
)
