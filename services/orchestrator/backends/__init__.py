"""Where training pods run: one interface (base.py), local processes and Kubernetes."""

from __future__ import annotations

from services.orchestrator.backends.base import Backend, PodInfo, PodRequest
from services.orchestrator.settings import OrchestratorSettings


def make_backend(settings: OrchestratorSettings) -> Backend:
    if settings.backend == "kubernetes":
        from services.orchestrator.backends.kubernetes import KubernetesBackend

        return KubernetesBackend(settings)
    from services.orchestrator.backends.local import LocalBackend

    return LocalBackend(settings)


__all__ = ["Backend", "PodInfo", "PodRequest", "make_backend"]
