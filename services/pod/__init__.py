"""The training pod: P >= 1 agents in training, the only part of Podium that imports torch.

Layers, top to bottom; each imports only those below it (checked by import-linter's ``layers``
contract in pyproject.toml):

* ``runtime/`` — the pod as a process: ``rounds.py`` (the round loop over its slots: train a
  round, evaluate, report to the leaderboard, PBT's exploit across pods), ``in_pod_pbt.py``
  (PBT among a population's own agents), ``lineage.py`` (who each slot's agent is on the
  leaderboard), ``launcher.py`` (CPU pods forked from one process that imported torch once),
  ``metrics.py``, ``gpu_check.py`` (a pod granted GPUs it cannot use stops at start),
  ``compile_cache.py`` (torch.compile's cache on a volume that outlives the pod),
  ``compile_share.py`` (one compile per experiment: the first pod's cache published to the
  leaderboard's blob store, fetched by the others), ``pod_files.py`` (its TensorBoard files and
  last log lines kept in the blob store); ``__main__.py`` starts it as the orchestrator does.
* ``trading/`` — FinRL-style stock trading on the platform's parts: the market and the env,
  the portfolio gradient (its agents and trainer), the backtest.
* ``training/`` — ``trainer.py`` (the interface every way of training implements, and which
  trainer trains an algorithm: its card's family), the trainers (``onpolicy.py``,
  ``offpolicy.py``), ``fit.py`` (``podium train``'s loop), ``presets.py``, ``checkpoint.py``
  (training files), ``fusion.py`` (learner replicas averaged), ``tensorboard.py`` (curves and
  hyperparameters as TensorBoard event files).
* ``roles/`` — ``worker.py`` (collects: PPO's rollout as functions over a functional env, or a
  host env's steps), ``learner.py`` (updates: PPO's iteration, the off-policy K-step update),
  ``evaluator.py`` (scores), in the pod's one process.
* ``algorithms/`` — each algorithm's maths once, as functions batched over P agents (``ppo.py``,
  ``sac.py``, ``ddpg.py`` with ``td3.py``, ``dqn.py``), with the shared machinery beside them:
  ``policies.py`` (the batched MLP and action distributions), ``adam.py`` (the one Adam),
  ``flat.py`` (P agents' parameters as one flat tensor), ``stacked.py`` (off-policy agents
  stacked, their replay and K-step update), ``compiled.py`` (the one compile path and the rule
  that decides whether compiling pays), ``counter_random.py`` (the compiled loops' random
  draws), normalisation, replay storage, noise.
* ``config.py`` — the run config every layer above reads.
* ``envs/`` — the environments, each defined once as a functional env (``functional.py``)
  with its vector env a thin wrapper (``base.py``), and the adapters to host simulators.

Adding an algorithm: its card folder (services/contracts/algorithms/<name>/: card, config,
presets), its agent module (for an off-policy one, its loss and update written once over P
agents and a ``Stack``: eager, compiled and in a population alike), and the entry points
``podium.algorithm_cards`` and ``podium.algorithms``; an algorithm of a new family also
registers its trainer under ``podium.trainers``. Adding an env: its functional env (or a vector
env), its card (``podium.env_cards``) and ``podium.envs``.

Before any of it imports torch, the package lets MKL choose its kernels by the CPU's
instruction sets (``mkl_dispatch.py``: on AMD CPUs MKL otherwise runs its generic ones).
"""

from services.pod import mkl_dispatch

mkl_dispatch.use_cpu_features()
