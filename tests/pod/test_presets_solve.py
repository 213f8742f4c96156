"""The presets generalise: ``podium train ENV --set algorithm=X`` solves ENV from its defaults.

Each case builds its config exactly as ``podium train`` does (services/pod/training/presets.py
``train_config``: the algorithm's preset for the env, then the user's layers, here the
algorithm and a fixed seed) and trains it with services/pod/training/fit.py's loop. It must reach
the env's solve threshold within the env-step budget documented in docs/benchmarks.md ("Presets
that generalise"); the preset may not grant itself a larger one. The cheap pairs run here
(Pendulum's off-policy agents are tested in test_offpolicy.py); bench/presets_solve.py
measures every pair over several seeds.
"""

from __future__ import annotations

import pytest

from services.contracts.envs import target_return
from services.pod.training.fit import train
from services.pod.training.presets import train_config

#: (algorithm, env) → the env-step budget to the solve threshold (docs/benchmarks.md).
BUDGETS = {
    ("ppo", "CartPole-v1"): 200_000,
    ("dqn", "CartPole-v1"): 60_000,
    ("ppo", "Acrobot-v1"): 500_000,
    ("dqn", "Acrobot-v1"): 50_000,
    ("ppo", "MountainCarContinuous-v0"): 100_000,
    # The hard-exploration pair: with independent noise SAC never leaves "do nothing" here
    # (docs/tournaments.md, "Tasks where the population matters"); pink noise finds the flag.
    ("sac", "MountainCarContinuous-v0"): 50_000,
    ("ppo", "Pendulum-v1"): 100_000,
    # MuJoCo through EnvPool (the envpool extra, in dev): SAC, the fastest there, and TD3,
    # whose defaults (Pendulum's discount, a short random phase) miss the target in 250k env
    # steps; DDPG's preset is benchmarked.
    ("sac", "envpool:HalfCheetah-v5"): 150_000,
    ("td3", "envpool:HalfCheetah-v5"): 250_000,
}
#: The seed each pair trains with: PPO's Pendulum preset once failed seed 0 (gamma 0.9: a slow
#: swing-up, best -227 in 200k env steps), so that seed is the one tested.
SEEDS = {("ppo", "Pendulum-v1"): 0}


def _case(algorithm: str, env: str) -> object:
    # MuJoCo HalfCheetah takes minutes per case (SAC 2 min 45 s, TD3 2 min 10 s on one core,
    # 821 s together in CI under load): nightly only; each algorithm keeps a fast learning check
    # in every run (Pendulum in test_offpolicy.py, the pairs above).
    marks = [pytest.mark.nightly] if "HalfCheetah" in env else []
    return pytest.param(algorithm, env, id=f"{algorithm}-{env}", marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "env"), [_case(a, e) for a, e in BUDGETS])
def test_podium_train_solves_env_with_defaults(algorithm: str, env: str) -> None:
    seed = SEEDS.get((algorithm, env), 1)
    config = train_config(env, [{"algorithm": algorithm, "seed": seed}])
    budget = BUDGETS[algorithm, env]
    target = target_return(env)
    assert target is not None and config.target_return == target
    assert config.total_env_steps <= budget, "the preset's budget exceeds the documented one"
    result = train(config)
    assert result.best is not None
    assert result.solved_at_env_steps is not None, (
        f"{algorithm} on {env}: best eval {result.best.mean:.1f} < {target} "
        f"within {config.total_env_steps:,} env steps"
    )
    assert result.solved_at_env_steps <= budget
