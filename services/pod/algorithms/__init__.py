"""The agents a pod trains: each module holds one algorithm's networks, loss and update; the
shared machinery (policies, normalisation, rollout and replay storage, exploration noise, the
compile helper) lives beside them. What is known of each algorithm without torch (its
hyperparameters, action kinds, family, presets) is its card, services/contracts/algorithms/.
Agents are found by registered name (entry-point group ``podium.algorithms``)."""
