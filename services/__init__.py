"""Podium: a Kubernetes-native platform for tournament-based ensemble deep RL.

Subpackages follow the data flow: ``orchestrator`` (experiments, scaling), ``pod`` (one agent in
training: worker / learner / evaluator; the only place torch is imported) and ``leaderboard``
(updater, generator); ``contracts`` holds what they agree on (spec, models, formats) and ``cli``
the ``podium`` command line. Modules directly in ``services`` are shared by the services and
stay light.
"""

__version__ = "0.1.0"
