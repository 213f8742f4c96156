"""The training pod: one agent (or a population of P) in training. The only part of Podium
that imports torch.

Read it top-down:

* ``runtime.py`` — the pod's round loop over its slots (train a round, evaluate, report to the
  leaderboard, PBT's exploit); ``__main__.py`` runs it as the orchestrator starts a pod;
  ``launcher.py`` forks CPU pods for the local backend from one process that imported torch
  once; ``lineage.py`` — who each slot's agent is on the leaderboard.
* ``fit.py`` — ``podium train``'s loop (budget, target, evaluate, save latest and best).
* ``trainer.py`` — the interface both loops drive, and the registry lookup of the trainer
  that trains an algorithm. Trainers: ``onpolicy.py`` (PPO), ``offpolicy.py`` (SAC, TD3,
  DDPG, DQN family), ``population_trainer.py`` (P PPO agents in one process, on
  ``population.py``).
* The roles: ``worker.py`` (collects), ``learner.py`` (updates), ``evaluator.py`` (scores);
  apart in processes or containers through ``multiprocess.py`` (learner side),
  ``role_process.py`` (worker and evaluator side) and ``transport.py`` (the link).
* ``presets.py`` + ``presets/<algorithm>/<env>.yaml`` — tuned starting points, as data;
  ``checkpoint.py`` — training files; ``algorithms/`` — the algorithms; ``envs/`` — the
  environments; ``fusion.py`` — learner replicas averaged; ``metrics.py``, ``backtest.py``.

Adding an algorithm: one module in ``algorithms/`` (a class declaring ``config_class``,
``action_spaces`` and ``trainer``), one config model, one preset file and one entry point in
the group ``podium.algorithms``.
"""
