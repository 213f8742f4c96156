"""Twin Delayed DDPG (Fujimoto et al. 2018): DDPG with its three fixes for overestimation.

ã  = clip(μ'(s') + clip(ε, −c, c), −1, 1),  ε ~ N(0, σ̃²)      (target policy smoothing)
y  = r + γ (1 − terminated) min_i Q'_i(s', ã)                  (clipped double Q)
critics: min Σ_i (Q_i(s, a) − y)²
every ``policy_delay`` updates:                                 (delayed policy updates)
    actor: max Q_1(s, μ(s));  targets: θ' ← (1 − τ) θ' + τ θ

DDPG's target and update already take the min over the critics and a policy delay; TD3 sets
two critics, its own delay and the smoothed target action (services/pod/algorithms/ddpg.py
``td3_update``, ``DDPGStack``).
"""

from __future__ import annotations

from services.contracts.algorithms.td3.config import TD3Config
from services.pod.algorithms.ddpg import DDPG


class TD3(DDPG):
    """DDPG with twin critics, target policy smoothing and delayed actor updates."""

    name = "td3"
    n_critics = 2
    smoothing = True
    config: TD3Config

    @property
    def policy_delay(self) -> int:
        return self.config.policy_delay
