"""The training pod: one agent (or a population of P) in training. The only part of Podium
that imports torch.

Layers, top to bottom; each imports only those below it (checked by import-linter's ``layers``
contract in pyproject.toml):

* ``runtime/`` — the pod as a process: ``rounds.py`` (the round loop over its slots: train a
  round, evaluate, report to the leaderboard, PBT's exploit), ``lineage.py`` (who each slot's
  agent is on the leaderboard), ``launcher.py`` (CPU pods forked from one process that imported
  torch once), ``metrics.py``, ``gpu_check.py`` (a pod granted GPUs it cannot use stops at
  start), ``compile_cache.py`` (torch.compile's cache on a volume that outlives the pod),
  ``compile_share.py`` (one compile per experiment: the first pod's cache published to the
  leaderboard's blob store, fetched by the others), ``pod_files.py`` (its TensorBoard files and
  last log lines kept in the blob store).
  ``__main__.py`` starts it as the orchestrator starts a pod.
* ``trading/`` — FinRL-style stock trading on the platform's parts: the market and the env,
  the portfolio gradient (its agent and trainer), the backtest, the in-process tournaments.
* ``training/`` — ``trainer.py`` (the interface every way of training implements, and which
  trainer trains an algorithm: its card's family), the trainers (``onpolicy.py``, ``offpolicy.py``,
  ``population_trainer.py`` on ``population.py``, ``anakin_trainer.py`` on ``anakin.py`` and
  ``anakin_eval.py``: PPO compiled, chosen by ``compile``), ``fit.py`` (``podium train``'s loop),
  ``presets.py``, ``checkpoint.py`` (training files), ``fusion.py`` (learner replicas averaged),
  ``tensorboard.py`` (curves and hyperparameters as TensorBoard event files).
* ``roles/`` — ``worker.py`` (collects), ``learner.py`` (updates), ``evaluator.py`` (scores);
  ``rollout_roles.py`` (PPO's roles built from a config, in one process); apart as processes or
  containers through ``multiprocess.py`` (learner side), ``role_process.py`` (worker and
  evaluator side) and ``transport.py`` (the link).
* ``algorithms/`` — the agents (losses and updates) with their shared machinery beside them
  (policies, normalisation, rollout and replay storage, noise, the compile helper; off-policy
  agents stacked for a population in ``stacked.py``, their compiled K-step update in
  ``kstep.py``, the counter-based random draws of the compiled loops in
  ``counter_random.py``).
* ``config.py`` — the run config every layer above reads.
* ``envs/`` — the environments and adapters.

Adding an algorithm: its card folder (services/contracts/algorithms/<name>/: card, config,
presets), its agent class, and the entry points ``podium.algorithm_cards`` and
``podium.algorithms``; an algorithm of a new family also registers its trainer under
``podium.trainers``.
"""
