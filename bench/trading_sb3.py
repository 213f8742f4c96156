"""The Ray arm's Stable-Baselines3 side of bench/stock_trading_vs_raytune.py: SB3's ``VecEnv``
over the Podium trading env, and the trainable's env and scoring functions.

A module of its own so that the Podium arm's driver (the same script) never imports
Stable-Baselines3, which is no part of Podium's start-up. Ray's workers import it by name
(``PYTHONPATH=bench``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from stable_baselines3.common.vec_env import VecEnv as SB3VecEnv
from stock_trading_vs_raytune import market_split, scoring_env

from services.pod.envs.base import VecEnv
from services.pod.trading.backtest import sharpe_of
from services.pod.trading.env import StockTradingEnv


class SB3View(SB3VecEnv):
    """Stable-Baselines3's ``VecEnv`` over a Podium ``VecEnv``: numpy in and out, SB3's info
    keys (``terminal_observation``, ``TimeLimit.truncated``, ``episode``) where an episode
    ended. The Podium env autoresets as SB3 expects."""

    def __init__(self, env: VecEnv) -> None:
        self.env = env
        super().__init__(env.num_envs, env.single_observation_space, env.single_action_space)
        self._actions: np.ndarray | None = None

    def reset(self) -> np.ndarray:
        obs, _ = self.env.reset()
        self._reset_seeds()
        return obs.numpy()

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = actions

    def step_wait(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict]]:
        import torch

        assert self._actions is not None
        obs, reward, terminated, truncated, info = self.env.step(
            torch.as_tensor(self._actions, dtype=torch.float32)
        )
        done = (terminated | truncated).numpy()
        infos: list[dict] = [{} for _ in range(self.num_envs)]
        for i in np.flatnonzero(done):
            infos[i] = {
                "terminal_observation": info["final_obs"][i].numpy(),
                "TimeLimit.truncated": bool(truncated[i] and not terminated[i]),
                "episode": {
                    "r": float(info["episode_return"][i]),
                    "l": int(info["episode_length"][i]),
                },
            }
        return obs.numpy(), reward.numpy().astype(np.float32), done, infos

    def close(self) -> None:
        self.env.close()

    def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
        return [getattr(self.env, attr_name, None)] * len(self._get_indices(indices))

    def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
        raise NotImplementedError("SB3View: the Podium env has no per-sub-env attributes")

    def env_method(self, method_name: str, *args: Any, indices: Any = None, **kw: Any) -> list:
        raise NotImplementedError("SB3View: the Podium env has no per-sub-env methods")

    def env_is_wrapped(self, wrapper_class: type, indices: Any = None) -> list[bool]:
        return [False] * len(self._get_indices(indices))


def trading_env(regime: str, seed: int, _env_id: str, n_envs: int, env_seed: int) -> SB3View:
    """``make_env`` of the SB3 trainable: the market's train period, as the tournament's."""
    periods, kwargs = market_split(regime, seed)
    env = StockTradingEnv(n_envs, mode="train", data=periods["train"], seed=env_seed, **kwargs)
    return SB3View(env)


def trading_scores(regime: str, seed: int, model: Any, env: Any) -> dict[str, float]:
    """``evaluate`` of the SB3 trainable: the policy's Sharpe over one deterministic pass of
    the validation period (the score PBT ranks by) and, to report only, of the backtest
    period; observations normalised by the training env's statistics."""
    import torch
    from stable_baselines3.common.vec_env import VecNormalize

    from services.pod.trading.backtest import run_backtest

    normalize = env.normalize_obs if isinstance(env, VecNormalize) else (lambda o: o)

    def act(obs: torch.Tensor) -> torch.Tensor:
        action, _ = model.predict(normalize(obs.numpy()), deterministic=True)
        return torch.as_tensor(action, dtype=torch.float32)

    score = sharpe_of(run_backtest(scoring_env(regime, seed, "validation"), act))
    # The backtest pass is for the report only (Podium's arm makes it once, after the
    # tournament): timed, so its cost can be taken out of Ray's clock.
    start = time.process_time()
    backtest = sharpe_of(run_backtest(scoring_env(regime, seed, "backtest"), act))
    return {
        "score": score,
        "backtest_sharpe": backtest,
        "report_cpu_s": time.process_time() - start,
    }
