"""PPO's card: clipped-surrogate policy optimisation, on-policy, any action space."""

from services.contracts.algorithms.card import ON_POLICY, AlgorithmCard, PopulationCard
from services.contracts.algorithms.ppo.config import PPOConfig

CARD = AlgorithmCard(
    name="ppo",
    label="PPO",
    family=ON_POLICY,
    config=PPOConfig,
    action_kinds=("discrete", "continuous"),
    # The fields that enter a population's update as per-agent tensors
    # (services/pod/training/population.py); gSDE's noise and the KL early stop (which would
    # end one agent's epochs and not the others') have no batched form.
    population=PopulationCard(
        hyperparameters=(
            "learning_rate",
            "ent_coef",
            "clip_coef",
            "vf_coef",
            "gamma",
            "gae_lambda",
        ),
        unsupported={"sde_sample_freq": "gSDE", "target_kl": "target_kl"},
    ),
    presets_package=__name__,
    summary="Proximal Policy Optimization (clipped surrogate, GAE)",
)
