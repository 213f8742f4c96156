"""The roles: worker, learner, evaluator (services/pod/__init__.py)."""
