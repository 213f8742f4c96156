"""Pod credentials: the bearer token a training pod uses, scoped to its own experiment.

A pod needs four things of the leaderboard: ask the generator where to start, submit its
results, download its parent's files and release its lease. The platform token can do anything
on both services (cancel or delete any experiment), so pods never get it. Each pod gets instead

    pod.<experiment_id>.<signature>

with ``signature`` = base64url(HMAC-SHA256(key = the leaderboard's API token, message =
``CONTEXT`` + experiment id)). The orchestrator, which holds the leaderboard's token, mints it;
the leaderboard checks it without a database round trip and lets it do exactly those four
things for that experiment (403 anywhere else); the orchestrator, whose token it is not, refuses
it (401). HMAC is one-way: the credential reveals neither the platform token nor another
experiment's credential. It changes when the platform token is rotated, and needs no clean-up:
it is worthless once its experiment is deleted (experiment ids are random and not reused).
"""

from __future__ import annotations

import base64
import hashlib
import hmac

# What gives access to the whole platform: a pod inherits none of it (least privilege). Its
# PODIUM_API_TOKEN is its experiment's credential instead (``pod_credential``).
PLATFORM_SECRETS = frozenset(
    {
        "PODIUM_API_TOKEN",
        "PODIUM_API_TOKEN_FILE",
        "PODIUM_LEADERBOARD_TOKEN",
        "PODIUM_TOKEN",
        "REDIS_URL",
        "PODIUM_REDIS_URL",
    }
)

PREFIX = "pod."
CONTEXT = b"podium pod credential v1\n"


def _signature(secret: str, experiment_id: str) -> str:
    mac = hmac.new(secret.encode(), CONTEXT + experiment_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def pod_token(secret: str, experiment_id: str) -> str:
    """The credential of ``experiment_id``'s pods, derived from the leaderboard's token."""
    return f"{PREFIX}{experiment_id}.{_signature(secret, experiment_id)}"


def pod_token_experiment(secret: str, token: str) -> str | None:
    """The experiment a valid pod credential is for; None for anything else (constant-time)."""
    if not token.startswith(PREFIX) or "." not in token[len(PREFIX) :]:
        return None
    experiment_id, signature = token[len(PREFIX) :].rsplit(".", 1)
    expected = _signature(secret, experiment_id)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return None
    return experiment_id
