"""The worker: steps the environment with the current policy, one kind per way of learning.

* On-policy (PPO): ``rollout`` takes ``steps`` vector steps of P agents' N sub-environments
  each into (steps, P, N, ...) buffers, one function for every env: a functional env's
  ``vector_step`` (services/pod/envs/functional.py: pure, so a chunk of steps compiles into one
  program and replays in a CUDA graph) or a host-stepped ``VecEnv``'s (gymnasium, EnvPool,
  Isaac: ``HostStep``). Its randomness is counter-based
  (services/pod/algorithms/counter_random.py) on the agents' seeds and the iteration, so
  compiled and eager runs draw the same numbers and a chunk draws its own slice of the
  iteration's. ``collect`` runs the rollout in chunks of a compiled program's length, or whole.
* Off-policy: ``ReplayWorker`` takes one vector step of P stacked agents per call, each in its
  own slice of the env, appending each agent's transitions to its buffer of a
  ``StackedReplay`` (services/pod/algorithms/stacked.py), which the learner samples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from services.pod.algorithms import policies as pi
from services.pod.algorithms.counter_random import box_muller, uniform
from services.pod.algorithms.ppo import PPOShape, normalize, rollout_noise
from services.pod.algorithms.stacked import Stack, StackedReplay
from services.pod.envs.base import VecEnv
from services.pod.envs.functional import EnvCarry, EnvStep, FunctionalEnv, vector_step

#: A rollout's random streams (PPO's minibatch orders: stream 3): no two purposes share draws.
ACTION_STREAM, RESET_STREAM, SDE_STREAM, START_STREAM = 0, 1, 2, 4


class Carry(NamedTuple):
    """A rollout's carry from step to step: the raw observations (P, N, D); the functional env's
    carry (None for a host-stepped env, which keeps its own); the discounted return (P, N) of each
    env, for reward normalisation; gSDE's noise matrices (P, N, L, A; empty without gSDE)."""

    obs: torch.Tensor
    env: EnvCarry | None
    discounted: torch.Tensor
    sde: torch.Tensor


class HostStep:
    """The env step of a host-stepped ``VecEnv`` of P * N sub-environments (agent p in the
    slice [p * N, (p + 1) * N)), which resets its episodes itself."""

    #: It draws no reset uniforms: the env resets its episodes from its own generator.
    reset_uniforms = 0

    def __init__(self, env: VecEnv, agents: int) -> None:
        self.env, self.agents = env, agents

    def __call__(
        self, carry: EnvCarry | None, action: torch.Tensor, reset_u: torch.Tensor
    ) -> tuple[None, EnvStep]:
        p = self.agents
        obs, reward, terminated, truncated, info = self.env.step(
            action.reshape(-1, *action.shape[2:])
        )
        per_agent = lambda x: x.view(p, -1, *x.shape[1:])  # noqa: E731
        ep_return = info["episode_return"]
        return None, EnvStep(
            obs=per_agent(obs),
            reward=per_agent(reward),
            terminated=per_agent(terminated),
            truncated=per_agent(truncated),
            final_obs=per_agent(info["final_obs"]),
            episode_return=per_agent(ep_return),
            episode_length=per_agent(info["episode_length"]),
            episode_score=per_agent(info.get("episode_score", ep_return)),
        )


#: What ``rollout`` stores per step, in order (``raw``: the observations before normalisation;
#: ``discounted``: each env's discounted return after the step).
STEP_KEYS = (
    "raw", "obs", "actions", "logprobs", "rewards", "terminated", "truncated", "final_obs",
    "discounted", "episode_return", "episode_score",
)  # fmt: skip


def _normal(u: torch.Tensor) -> torch.Tensor:
    """Standard normals from pairs of uniforms (Box-Muller): (..., 2k) -> (..., k)."""
    return box_muller(*u.chunk(2, dim=-1))


def noise_widths(shape: PPOShape, reset_uniforms: int) -> tuple[int, int, int]:
    """Uniforms per agent and step of each stream: the actions', the resets', gSDE's."""
    spec, n = shape.policy, shape.num_envs
    action = 0 if spec.kind == "sde" else n * spec.actions * (1 if spec.discrete else 2)
    sde = 2 * n * spec.actions * spec.latent_features if spec.kind == "sde" else 0
    return action, n * reset_uniforms, sde


def rollout(
    shape: PPOShape,
    env: FunctionalEnv | HostStep,
    params: torch.Tensor,
    stats: Mapping[str, torch.Tensor],
    carry: Carry,
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor | int],
    gamma: torch.Tensor,
    steps: int,
) -> tuple[Carry, dict[str, torch.Tensor]]:
    """``steps`` vector steps of all P agents: normalise (frozen statistics), act, step the
    env, record. ``params``: the flat (P, n) weights; ``stats``: ``obs_mean``, ``obs_var``;
    ``counter``: (seeds (P,), iteration, the first step's index in the iteration), what the
    draws are a function of; ``gamma`` (P,): for the discounted returns. Returns the carry and
    the buffers, (steps, P, N, ...) each (``STEP_KEYS``)."""
    spec, p, n = shape.policy, shape.agents, shape.num_envs
    views = shape.layout.views(params)
    seed, iteration, start = counter
    widths = noise_widths(shape, env.reset_uniforms)
    draw = lambda stream, width: rollout_noise(  # noqa: E731
        shape, seed, iteration, stream, width, start, steps
    )
    action_u = draw(ACTION_STREAM, widths[0]) if widths[0] else None
    reset_u = draw(RESET_STREAM, widths[1]).view(steps, p, n, -1) if widths[1] else None
    sde_u = draw(SDE_STREAM, widths[2]) if widths[2] else None
    g = gamma.to(torch.float64).view(p, 1)
    out: list[tuple[torch.Tensor, ...]] = []
    for k in range(steps):
        raw = carry.obs
        obs = normalize(shape, stats, raw)
        sde = carry.sde
        if sde_u is not None:  # gSDE's noise is new every sde_period steps: drawn only then
            # A chunk starts at a multiple of ``steps``: where the period is one too, its later
            # steps are never due (else a compiled chunk's are known only as a tensor).
            due = False if k and not spec.sde_period % steps else (start + k) % spec.sde_period == 0
            if due is not False:
                normal = _normal(sde_u[k]).view(p, n, spec.latent_features, spec.actions)
                fresh = pi.sde_noise(spec, views, normal)
                sde = fresh if due is True else torch.where(due, fresh, sde)
        noise = torch.zeros(p, n, 0, device=raw.device)
        if action_u is not None:
            u = action_u[k].view(p, n, -1)
            noise = u if spec.discrete else _normal(u)
        action, logp = pi.sample(spec, views, obs, noise, sde)
        reset = reset_u[k] if reset_u is not None else raw.new_zeros(p, n, 0)
        env_action = pi.to_env(spec, action)
        if isinstance(env, FunctionalEnv):  # pure: it compiles
            env_carry, step = vector_step(env, carry.env, env_action, reset)
        else:  # a host-stepped env resets its episodes itself
            env_carry, step = env(carry.env, env_action, reset)
        done = step.terminated | step.truncated
        discounted = carry.discounted * g + step.reward.to(torch.float64)
        out.append((
            raw, obs, action, logp, step.reward.to(torch.float32), step.terminated,
            step.truncated, normalize(shape, stats, step.final_obs), discounted,
            step.episode_return.to(torch.float32), step.episode_score.to(torch.float32),
        ))  # fmt: skip
        carry = Carry(step.obs, env_carry, discounted.masked_fill(done, 0.0), sde)
    buffers = {k: torch.stack(v) for k, v in zip(STEP_KEYS, zip(*out, strict=True), strict=True)}
    return carry, buffers


def start_carry(
    shape: PPOShape, env: FunctionalEnv | None, obs: torch.Tensor | None, seeds: torch.Tensor
) -> Carry:
    """A rollout's first carry: a functional env's episodes started from counter-based draws
    of the agents' seeds, or a host-stepped env's first observations ``obs`` (P, N, D)."""
    p, n, spec = shape.agents, shape.num_envs, shape.policy
    device = seeds.device
    env_carry = None
    if env is not None:
        u = uniform(seeds, torch.tensor(-1, device=device), START_STREAM, (n, env.reset_uniforms))
        env_carry = env.start(u.to(env.dtype))
        obs = env.observe(env_carry.state)
    assert obs is not None
    sde_shape = (spec.latent_features, spec.actions) if spec.kind == "sde" else (0,)
    sde = torch.zeros(p, n, *sde_shape, device=device)
    return Carry(obs, env_carry, torch.zeros(p, n, dtype=torch.float64, device=device), sde)


#: ``steps`` steps from a carry: ``rollout`` with shape and env bound, or its compiled program.
ChunkFn = Callable[..., tuple[Carry, dict[str, torch.Tensor]]]


def collect(
    shape: PPOShape,
    state: Mapping[str, torch.Tensor],
    carry: Carry,
    hp: Mapping[str, torch.Tensor],
    chunk_fn: ChunkFn,
    chunk: int,
) -> tuple[Carry, dict[str, torch.Tensor]]:
    """One iteration's ``shape.num_steps`` steps in calls of ``chunk_fn`` of ``chunk`` steps (a
    divisor of it): the buffers (T, P, N, ...) and ``next_obs`` (P, N, D), normalised."""
    stats = {"obs_mean": state["obs_mean"], "obs_var": state["obs_var"]}
    parts: list[dict[str, torch.Tensor]] = []
    starts: tuple[torch.Tensor | int, ...] = (0,)
    if chunk < shape.num_steps:
        starts = torch.arange(0, shape.num_steps, chunk, device=state["seed"].device).unbind()
    for start in starts:
        counter = (state["seed"], state["iteration"], start)
        carry, part = chunk_fn(state["params"], stats, carry, counter, hp["gamma"])
        parts.append(part)
    roll = parts[0] if len(parts) == 1 else {k: torch.cat([x[k] for x in parts]) for k in parts[0]}
    roll["next_obs"] = normalize(shape, stats, carry.obs)
    return carry, roll


class EpisodeTally:
    """The returns of P agents' finished training episodes, summed per agent on the device
    (read only when asked). Each reader (``since``) gets what ended since its own last read: a
    record of the curves and PBT's ranking read the same episodes apart."""

    def __init__(self, p: int, device: torch.device | str) -> None:
        self.returns = torch.zeros(p, device=device, dtype=torch.float64)
        self.episodes = torch.zeros(p, device=device, dtype=torch.int64)
        self._read: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, returns: torch.Tensor, episodes: torch.Tensor) -> None:
        """Per agent (P,): the summed returns and the count of the episodes that just ended."""
        self.returns += returns
        self.episodes += episodes

    def since(self, reader: str) -> tuple[list[float], list[int]]:
        """Per agent: the summed returns and count of the episodes ended since ``reader`` read."""
        returns, episodes = self.returns.clone(), self.episodes.clone()
        before = self._read.get(reader)
        self._read[reader] = (returns, episodes)
        if before is not None:
            returns, episodes = returns - before[0], episodes - before[1]
        return returns.tolist(), episodes.tolist()

    def mean(self, reader: str) -> float | None:
        """Mean return of every agent's episodes ended since ``reader``'s last call."""
        returns, episodes = self.since(reader)
        return sum(returns) / sum(episodes) if sum(episodes) else None

    def means(self, reader: str) -> list[float | None]:
        """Each agent's mean return of its episodes ended since ``reader``'s last call."""
        returns, episodes = self.since(reader)
        return [r / n if n else None for r, n in zip(returns, episodes, strict=True)]


class ReplayWorker:
    """Steps P stacked agents' env of P * n sub-environments once per call, agent p acting in
    the slice [p * n, (p + 1) * n) (uniform random actions until the agents have taken
    ``learning_starts`` env steps, then exploring, each on its own schedule:
    ``slot_env_steps``, each agent's env steps (P,) on the device, which the learner counts in
    place), and appends each agent's n transitions to its own buffer of ``replay``, on the
    env's device. The returns of every agent's finished episodes are tallied per agent."""

    def __init__(
        self,
        env: VecEnv,
        population: Stack,
        replay: StackedReplay,
        generator: torch.Generator,
        learning_starts: int,
        seed: int,
        slot_env_steps: torch.Tensor,
    ) -> None:
        self.env, self.population, self.replay = env, population, replay
        self.generator, self.learning_starts, self.seed = generator, learning_starts, seed
        self.slot_env_steps = slot_env_steps
        self.obs: torch.Tensor | None = None  # the current observations; None: reset first
        self.tally = EpisodeTally(replay.p, env.device)

    def reset(self, env_steps: int) -> None:
        """Start fresh episodes (seeded by the env steps so far, so a resumed run differs)."""
        self.obs, _ = self.env.reset(seed=self.seed + env_steps)
        self.population.end_episodes(
            torch.ones(self.env.num_envs, dtype=torch.bool, device=self.env.device)
        )

    def step(self, env_steps: int) -> int:
        """One vector step (``env_steps``: the agents' count so far); each agent's env steps."""
        if self.obs is None:
            self.reset(env_steps)
        pop, gen, p = self.population, self.generator, self.replay.p
        n = self.env.num_envs // p
        obs = self.obs.view(p, n, -1)
        if env_steps < self.learning_starts:
            action = pop.random_action(p * n, gen).view(p, n, *pop.action_shape)
        else:
            action = pop.explore(obs, gen, self.slot_env_steps)
        flat = action.reshape(p * n, *pop.action_shape)
        next_obs, reward, terminated, truncated, info = self.env.step(pop.template.to_env(flat))
        # next_obs of an ended episode is its final observation, not the reset one.
        final_obs = info["final_obs"].view(p, n, -1)
        self.replay.add(obs, action, reward.view(p, n), final_obs, terminated.view(p, n))
        self.obs = next_obs
        done = terminated | truncated
        # episode_return is zero where no episode ended.
        self.tally.add(info["episode_return"].view(p, n).sum(1), done.view(p, n).sum(1))
        pop.end_episodes(done)
        return n
