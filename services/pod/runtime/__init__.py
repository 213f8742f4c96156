"""The pod as a process: the round loop, lineage, launcher, metrics (services/pod/__init__.py)."""
