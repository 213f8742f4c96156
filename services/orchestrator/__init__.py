"""Orchestrator: experiments API, capacity-aware reconciler, local and Kubernetes backends."""
