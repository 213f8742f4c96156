"""The pod as a process: the round loop, lineage, the launcher, metrics
(services/pod/__init__.py)."""
