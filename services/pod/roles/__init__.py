"""The roles: worker, learner, evaluator, and where they run (services/pod/__init__.py)."""
