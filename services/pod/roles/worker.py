"""The worker: steps the batched environment with the current policy.

Two kinds, one per way of learning:

* ``RolloutWorker`` (on-policy, PPO): ``num_steps`` steps of every sub-environment per call,
  recorded as a ``Rollout`` of (T, N, ...) tensors allocated per call on the env's device. In
  the processes/containers split (services/pod/roles/multiprocess.py) the worker's process copies
  the rollout into a shared-memory file that the learner maps.
* ``ReplayWorker`` (off-policy): one vector step per call, its transitions appended to the
  replay buffer the learner samples (services/pod/roles/learner.py ``ReplayLearner``);
  ``PopulationReplayWorker`` the same for P stacked agents, each in its own slice of the env,
  into its own buffer of a ``StackedReplay`` (services/pod/algorithms/stacked.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.pod.algorithms.compiled import Compiled
from services.pod.algorithms.normalization import batch_stats
from services.pod.algorithms.policies import Policy
from services.pod.algorithms.replay_buffer import ReplayBuffer
from services.pod.algorithms.rollout import Rollout
from services.pod.algorithms.stacked import StackedReplay
from services.pod.envs.base import TorchVecEnv, VecEnv


class RolloutWorker:
    """Collects ``num_steps`` steps from every sub-environment per call to ``collect``."""

    def __init__(
        self,
        env: VecEnv,
        policy: Policy,
        num_steps: int,
        gamma: float = 0.99,
        seed: int | None = None,
    ) -> None:
        self.env = env
        self.policy = policy
        self.num_steps = num_steps
        self.gamma = gamma
        self.device = env.device
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        raw_obs, _ = env.reset(seed=seed)
        self._raw_obs = raw_obs
        # Per-env discounted return, for reward scaling: it spans rollouts, so it lives here.
        self._discounted = torch.zeros(env.num_envs, device=self.device, dtype=torch.float64)

    def load_policy(self, state: dict[str, torch.Tensor]) -> None:
        """Take new weights from a learner in another process (no-op need when fused)."""
        self.policy.load_state_dict(state)

    @torch.no_grad()
    def collect(self) -> Rollout:
        env, policy, steps, n = self.env, self.policy, self.num_steps, self.env.num_envs
        obs_shape = self._raw_obs.shape[1:]
        obs = torch.empty((steps, n, *obs_shape), device=self.device)
        raw = torch.empty((steps, n, *obs_shape), device=self.device)
        final_obs = torch.empty_like(obs)
        rewards = torch.empty((steps, n), device=self.device)
        logprobs = torch.empty((steps, n), device=self.device)
        terminated = torch.empty((steps, n), device=self.device, dtype=torch.bool)
        truncated = torch.empty_like(terminated)
        returns = torch.empty((steps, n), device=self.device, dtype=torch.float64)
        ep_return = torch.empty((steps, n), device=self.device, dtype=torch.float32)
        ep_length = torch.empty((steps, n), device=self.device, dtype=torch.int64)
        actions: torch.Tensor | None = None

        raw_obs = self._raw_obs
        noise_period = getattr(policy.actor, "noise_period", 0)  # gSDE actors only
        for t in range(steps):
            if noise_period and t % noise_period == 0:
                policy.actor.resample_noise(n, self.generator)
            raw[t] = raw_obs
            norm = policy.normalize(raw_obs)
            obs[t] = norm
            action, logprob = policy.actor.sample(norm, self.generator)
            if actions is None:
                actions = torch.empty(
                    (steps, *action.shape), device=self.device, dtype=action.dtype
                )
            actions[t] = action
            logprobs[t] = logprob
            raw_obs, reward, term, trunc, info = env.step(policy.actor.to_env(action))
            rewards[t] = reward
            terminated[t] = term
            truncated[t] = trunc
            final_obs[t] = policy.normalize(info["final_obs"])
            done = term | trunc
            self._discounted.mul_(self.gamma).add_(reward)
            returns[t] = self._discounted
            self._discounted.masked_fill_(done, 0.0)
            ep_return[t] = info["episode_return"]
            ep_length[t] = info["episode_length"]
        self._raw_obs = raw_obs
        # One boolean gather per rollout (not per step): on CUDA it is the only host sync.
        done_mask = terminated | truncated
        assert actions is not None
        return Rollout(
            obs=obs,
            actions=actions,
            logprobs=logprobs,
            rewards=rewards,
            terminated=terminated,
            truncated=truncated,
            final_obs=final_obs,
            next_obs=policy.normalize(raw_obs),
            obs_stats=batch_stats(raw, tuple(obs_shape)),
            return_stats=batch_stats(returns),
            episode_returns=ep_return[done_mask].float(),
            episode_lengths=ep_length[done_mask],
        )


def rollout_step(
    policy: Policy,
    env: TorchVecEnv,
    raw_obs: torch.Tensor,
    noise: torch.Tensor,
    fresh: torch.Tensor,
    t: torch.Tensor,
    gamma: torch.Tensor,
    discounted: torch.Tensor,
    store: dict[str, torch.Tensor],
) -> torch.Tensor:
    """One vector step of the fused loop: act, step the env (masked reset), write row ``t``
    (a 1-element index tensor: an int would be a constant of the graph) of every ``store``
    buffer; returns the next raw observations. No generator, no host sync: its randomness
    (``noise`` for the actor, ``fresh`` initial states) is drawn by the caller, so the whole
    function is one graph for ``torch.compile`` (services/pod/algorithms/compiled.py)."""
    norm = policy.normalize(raw_obs)
    action, logprob = policy.actor.sample(norm, noise=noise)
    next_obs, reward, term, trunc, info = env.step_masked(policy.actor.to_env(action), fresh)
    discounted.mul_(gamma).add_(reward)
    row = {
        "raw": raw_obs,
        "obs": norm,
        "actions": action,
        "logprobs": logprob,
        "rewards": reward,
        "terminated": term,
        "truncated": trunc,
        "final_obs": policy.normalize(info["final_obs"]),
        "returns": discounted,
        "ep_return": info["episode_return"],
        "ep_length": info["episode_length"],
    }
    for key, value in row.items():
        store[key].index_copy_(0, t, value.unsqueeze(0).to(store[key].dtype))
    discounted.masked_fill_(term | trunc, 0.0)
    return next_obs


_compiled_step = Compiled(rollout_step, "rollout_step")


class FusedRolloutWorker(RolloutWorker):
    """The Anakin worker for torch-native envs: every vector step is one call of
    ``rollout_step``, compiled (``compile=True``) or eager (the same code, for checking the
    compiled one). The rollout buffers are allocated once and reused (the learner reads a
    rollout before the next ``collect``), and the env resets finished sub-environments by
    mask, as it does on an accelerator; so its trajectories are not bit-equal to
    ``RolloutWorker``'s, which resets by index on CPU, only equal in distribution."""

    def __init__(
        self,
        env: TorchVecEnv,
        policy: Policy,
        num_steps: int,
        gamma: float = 0.99,
        seed: int | None = None,
        compile: bool = True,
    ) -> None:
        super().__init__(env, policy, num_steps, gamma, seed)
        self.env: TorchVecEnv = env
        self.compile = compile
        self._gamma = torch.tensor(gamma, device=self.device, dtype=torch.float64)
        self._steps = torch.arange(num_steps, device=self.device).unsqueeze(1)
        self._store: dict[str, torch.Tensor] | None = None

    def _buffers(self) -> dict[str, torch.Tensor]:
        steps, n, dev = self.num_steps, self.env.num_envs, self.device
        space = self.env.single_action_space
        obs_shape = tuple(self._raw_obs.shape[1:])
        floats = {"raw": obs_shape, "obs": obs_shape, "final_obs": obs_shape, "logprobs": ()}
        store = {k: torch.empty((steps, n, *s), device=dev) for k, s in floats.items()}
        if self.env.is_discrete:  # the actors' action tensors (worker.Rollout)
            store["actions"] = torch.empty((steps, n), device=dev, dtype=torch.int64)
        else:
            store["actions"] = torch.empty((steps, n, *space.shape), device=dev)
        store["rewards"] = torch.empty((steps, n), device=dev)
        store["ep_return"] = torch.empty((steps, n), device=dev)
        store["returns"] = torch.empty((steps, n), device=dev, dtype=torch.float64)
        store["ep_length"] = torch.empty((steps, n), device=dev, dtype=torch.int64)
        for key in ("terminated", "truncated"):
            store[key] = torch.empty((steps, n), device=dev, dtype=torch.bool)
        return store

    @torch.no_grad()
    def collect(self) -> Rollout:
        env, policy, n = self.env, self.policy, self.env.num_envs
        actor = policy.actor
        noise_period = getattr(actor, "noise_period", 0)  # gSDE actors only
        if self._store is None:
            self._store = self._buffers()
        store, raw_obs = self._store, self._raw_obs
        cuda_graphs = self.compile and self.device.type == "cuda"
        for t in range(self.num_steps):
            if noise_period and t % noise_period == 0:
                actor.resample_noise(n, self.generator)
            noise = actor.draw_noise(n, self.generator, self.device)
            fresh = env._initial_state(n)
            args = (policy, env, raw_obs, noise, fresh, self._steps[t], self._gamma)
            if self.compile:
                raw_obs = _compiled_step(type(env), self.device, *args, self._discounted, store)
            else:
                raw_obs = rollout_step(*args, self._discounted, store)
        # A CUDA graph's output is overwritten by its next replay: keep a copy across calls.
        self._raw_obs = raw_obs = raw_obs.clone() if cuda_graphs else raw_obs
        done_mask = store["terminated"] | store["truncated"]
        return Rollout(
            obs=store["obs"],
            actions=store["actions"],
            logprobs=store["logprobs"],
            rewards=store["rewards"],
            terminated=store["terminated"],
            truncated=store["truncated"],
            final_obs=store["final_obs"],
            next_obs=policy.normalize(raw_obs),
            obs_stats=batch_stats(store["raw"], tuple(raw_obs.shape[1:])),
            return_stats=batch_stats(store["returns"]),
            episode_returns=store["ep_return"][done_mask],
            episode_lengths=store["ep_length"][done_mask],
        )


class ExploringAgent(Protocol):
    """What a ``ReplayWorker`` needs of an off-policy agent (services/pod/algorithms/)."""

    def random_action(self, n: int, generator: torch.Generator) -> torch.Tensor: ...
    def explore(
        self, obs: torch.Tensor, generator: torch.Generator, env_steps: int
    ) -> torch.Tensor: ...
    def to_env(self, action: torch.Tensor) -> torch.Tensor: ...
    def end_episodes(self, done: torch.Tensor) -> None: ...


class ReplayWorker:
    """Steps every sub-environment once per call with the exploring policy (uniform random
    actions until ``learning_starts``) and appends the N transitions to the replay buffer, which
    lives on the env's device."""

    def __init__(
        self,
        env: VecEnv,
        agent: ExploringAgent,
        buffer: ReplayBuffer,
        generator: torch.Generator,
        learning_starts: int,
        seed: int,
    ) -> None:
        self.env, self.agent, self.buffer, self.generator = env, agent, buffer, generator
        self.learning_starts, self.seed = learning_starts, seed
        self.obs: torch.Tensor | None = None  # the current observations; None: reset first
        # Returns of finished episodes, summed on the device and read only when asked.
        self.return_sum = torch.zeros((), device=env.device, dtype=torch.float64)
        self.episodes = torch.zeros((), device=env.device, dtype=torch.int64)

    def reset(self, env_steps: int) -> None:
        """Start fresh episodes (seeded by the env steps so far, so a resumed run differs)."""
        self.obs, _ = self.env.reset(seed=self.seed + env_steps)
        self.agent.end_episodes(
            torch.ones(self.env.num_envs, dtype=torch.bool, device=self.env.device)
        )
        self.return_sum.zero_()
        self.episodes.zero_()

    def step(self, env_steps: int) -> int:
        """One vector step (``env_steps``: the agent's count so far); the env steps taken."""
        if self.obs is None:
            self.reset(env_steps)
        agent, gen, n = self.agent, self.generator, self.env.num_envs
        if env_steps < self.learning_starts:
            action = agent.random_action(n, gen)
        else:
            action = agent.explore(self.obs, gen, env_steps)
        next_obs, reward, terminated, truncated, info = self.env.step(agent.to_env(action))
        # next_obs of an ended episode is its final observation, not the reset one.
        self.buffer.add(self.obs, action, reward, info["final_obs"], terminated)
        self.obs = next_obs
        self.return_sum += info["episode_return"].sum()  # zero where no episode ended
        done = terminated | truncated
        self.episodes += done.sum()
        agent.end_episodes(done)
        return n

    def train_return(self) -> float | None:
        """Mean return of the episodes finished since the last call (None if none did)."""
        episodes = int(self.episodes)
        if not episodes:
            return None
        mean = float(self.return_sum) / episodes
        self.return_sum.zero_()
        self.episodes.zero_()
        return mean


class ExploringPopulation(Protocol):
    """What a ``PopulationReplayWorker`` needs of P stacked agents (services/pod/algorithms/
    stacked.py): they act on (P, n, ...) observations, the template agent draws the random
    actions and maps actions to the env's."""

    template: ExploringAgent
    action_shape: tuple[int, ...]

    def explore(
        self, obs: torch.Tensor, generator: torch.Generator, env_steps: torch.Tensor
    ) -> torch.Tensor: ...
    def end_episodes(self, done: torch.Tensor) -> None: ...


class PopulationReplayWorker(ReplayWorker):
    """``ReplayWorker`` for P stacked agents on one batched env of P * n sub-environments:
    agent p acts in the slice [p * n, (p + 1) * n) and appends its n transitions to its own
    buffer of ``replay``; the agents act at random until the population has taken
    ``learning_starts`` env steps, then explore, each on its own schedule: ``slot_env_steps``,
    each agent's env steps (P,) on the device, which the learner counts in place
    (services/pod/roles/learner.py ``PopulationReplayLearner``). The returns of every agent's
    episodes are counted together."""

    def __init__(
        self,
        env: VecEnv,
        population: ExploringPopulation,
        replay: StackedReplay,
        generator: torch.Generator,
        learning_starts: int,
        seed: int,
        slot_env_steps: torch.Tensor,
    ) -> None:
        # The base holds the population as the agent whose episodes ``reset`` starts (all
        # P * n of them) and the replay as its buffer; ``step`` is this class's own.
        super().__init__(
            env,
            population,  # type: ignore[arg-type]
            replay,  # type: ignore[arg-type]
            generator,
            learning_starts,
            seed,
        )
        self.population, self.replay, self.slot_env_steps = population, replay, slot_env_steps

    def step(self, env_steps: int) -> int:
        """One vector step (``env_steps``: the population's count so far); the env steps each
        agent took."""
        if self.obs is None:
            self.reset(env_steps)
        pop, gen, p = self.population, self.generator, self.replay.p
        n = self.env.num_envs // p
        obs = self.obs.view(p, n, -1)
        if env_steps < self.learning_starts:
            action = pop.template.random_action(p * n, gen).view(p, n, *pop.action_shape)
        else:
            action = pop.explore(obs, gen, self.slot_env_steps)
        flat = action.reshape(p * n, *pop.action_shape)
        next_obs, reward, terminated, truncated, info = self.env.step(pop.template.to_env(flat))
        final_obs = info["final_obs"].view(p, n, -1)
        self.replay.add(obs, action, reward.view(p, n), final_obs, terminated.view(p, n))
        self.obs = next_obs
        self.return_sum += info["episode_return"].sum()
        done = terminated | truncated
        self.episodes += done.sum()
        pop.end_episodes(done)
        return n
