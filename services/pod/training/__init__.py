"""Trainers and the loops that drive them (services/pod/__init__.py)."""
