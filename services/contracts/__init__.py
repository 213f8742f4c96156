"""Torch-free, Redis-free contracts shared by the orchestrator, leaderboard, pod and CLI.

Only pydantic models, value checks and pure functions live here, so any service imports it
without pulling in torch or a Redis client (the import-linter contracts in pyproject.toml hold
it to that):

- ``inputs``: what every input model shares (no extra fields, finite numbers, bounded JSON);
- ``spec``: the experiment spec a user submits;
- ``search_space``: hyperparameter distributions (sample, perturb, clamp);
- ``strategies``: the generator strategies' options and PBT's decisions;
- ``leaderboard``: the leaderboard API's request and response models;
- ``training_files``: the training-files format (manifest, digests, atomic directories).
"""
