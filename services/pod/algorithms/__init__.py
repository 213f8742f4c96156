"""Learning algorithms of the pod. Each module holds one algorithm's loss and update; shared
machinery (policies, normalisation, replay buffer) lives beside them. Their hyperparameter
models are torch-free (ppo_config.py, offpolicy_config.py; names per algorithm in
hyperparameters.py) so the control plane can validate a spec without torch. Algorithms are
found by registered name (entry-point group ``podium.algorithms``)."""
