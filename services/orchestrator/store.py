"""Experiment state and events in Redis: the reconciler's desired state and its status.

Keys (prefix ``podium:orch:``):

- ``experiments``: sorted set id → creation time.
- ``exp:<id>``: hash with ``spec`` (JSON), ``created_at``, ``intent`` (written only by the API:
  run / pause / cancel / delete) and ``status`` (JSON, written only by the reconciler), so the
  two writers never overwrite each other's fields.
- ``events:<id>``: stream of events (pod started / failed / replaced, scaled, target reached…).
- ``handled:<id>``: set of finished pods already accounted for (idempotent across restarts).
- ``idem:<key>``: idempotency key → experiment id and request hash (24 h).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from services.contracts.spec import ExperimentSpec

PREFIX = "podium:orch:"
EVENTS_MAXLEN = 10_000
IDEMPOTENCY_TTL_S = 24 * 3600

PENDING, RUNNING, PAUSED = "pending", "running", "paused"
SUCCEEDED, FAILED, CANCELLED, BUDGET_EXHAUSTED = (
    "succeeded",
    "failed",
    "cancelled",
    "budget_exhausted",
)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, BUDGET_EXHAUSTED})
STATES = (PENDING, RUNNING, PAUSED, SUCCEEDED, FAILED, CANCELLED, BUDGET_EXHAUSTED)

RUN, PAUSE, CANCEL, DELETE = "run", "pause", "cancel", "delete"


@dataclass
class Experiment:
    id: str
    spec: ExperimentSpec
    created_at: float
    intent: str
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> str:
        return self.status.get("state", PENDING)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


class IdempotencyConflictError(Exception):
    """The idempotency key was used before with a different request body."""


class Store:
    def __init__(self, r: redis.Redis):
        self.r = r
        self._create = r.register_script(self._CREATE_LUA)

    def _k(self, *parts: str) -> str:
        return PREFIX + ":".join(parts)

    # KEYS: exp experiments idem; ARGV: id body_hash ttl (0: no key) spec created_at intent status.
    # Returns the key's earlier value (a replay) or nil (created).
    _CREATE_LUA = """
if tonumber(ARGV[3]) > 0 then
  local prior = redis.call('GET', KEYS[3])
  if prior then return prior end
  redis.call('SET', KEYS[3], ARGV[1] .. ' ' .. ARGV[2], 'EX', ARGV[3])
end
redis.call('HSET', KEYS[1], 'spec', ARGV[4], 'created_at', ARGV[5], 'intent', ARGV[6],
  'status', ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
return false
"""

    # -- experiments -------------------------------------------------------------------------
    def create(
        self,
        exp_id: str,
        spec: ExperimentSpec,
        idempotency_key: str | None = None,
        body_hash: str = "",
    ) -> tuple[str, bool]:
        """Store a new experiment; returns (id, created). A repeated key returns the first id.

        One Redis transaction either way (a Lua script with a key), so a concurrent retry or a
        crash can never see the key without its experiment, nor the experiment twice.
        """
        now = repr(time.time())
        status = {"state": PENDING, "reason": "waiting for the reconciler", "pods_launched": 0}
        fields = [spec.model_dump_json(), now, RUN, json.dumps(status)]
        keys = [self._k("exp", exp_id), self._k("experiments")]
        if not idempotency_key:
            self._create(keys=[*keys, self._k("idem", "-")], args=[exp_id, "", 0, *fields])
            return exp_id, True
        prior = self._create(
            keys=[*keys, self._k("idem", idempotency_key)],
            args=[exp_id, body_hash, IDEMPOTENCY_TTL_S, *fields],
        )
        if prior is None:
            return exp_id, True
        old_id, _, old_hash = prior.decode().partition(" ")
        if old_hash != body_hash:
            raise IdempotencyConflictError(old_id)
        return old_id, False

    def get(self, exp_id: str) -> Experiment | None:
        h = self.r.hgetall(self._k("exp", exp_id))
        if not h or b"spec" not in h:
            return None
        return Experiment(
            id=exp_id,
            spec=ExperimentSpec.model_validate_json(h[b"spec"]),
            created_at=float(h[b"created_at"]),
            intent=h.get(b"intent", b"run").decode(),
            status=json.loads(h.get(b"status", b"{}")),
        )

    def ids(self) -> list[str]:
        return [i.decode() for i in self.r.zrange(self._k("experiments"), 0, -1)]

    def list(self) -> list[Experiment]:
        out = []
        for i in self.ids():
            exp = self.get(i)
            if exp is not None:
                out.append(exp)
        return out

    def set_intent(self, exp_id: str, intent: str) -> None:
        self.r.hset(self._k("exp", exp_id), "intent", intent)

    def set_status(self, exp_id: str, status: dict[str, Any]) -> None:
        # Only when the experiment still exists: a status write must not resurrect a deletion.
        key = self._k("exp", exp_id)
        if self.r.exists(key):
            self.r.hset(key, "status", json.dumps(status))

    def delete(self, exp_id: str) -> None:
        pipe = self.r.pipeline()
        pipe.delete(self._k("exp", exp_id), self._k("events", exp_id), self._k("handled", exp_id))
        pipe.zrem(self._k("experiments"), exp_id)
        pipe.execute()

    # -- finished pods -----------------------------------------------------------------------
    def mark_handled(self, exp_id: str, pod_id: str) -> bool:
        """True the first time a finished pod is handed in (so it is counted exactly once)."""
        return bool(self.r.sadd(self._k("handled", exp_id), pod_id))

    # -- events ------------------------------------------------------------------------------
    def event(self, exp_id: str, type_: str, message: str, pod_id: str | None = None) -> None:
        fields = {"type": type_, "message": message, "ts": repr(time.time())}
        if pod_id:
            fields["pod_id"] = pod_id
        self.r.xadd(self._k("events", exp_id), fields, maxlen=EVENTS_MAXLEN, approximate=True)

    def events(self, exp_id: str, after: str | None = None, limit: int = 100) -> list[dict]:
        start = f"({after}" if after else "-"
        out = []
        for eid, f in self.r.xrange(self._k("events", exp_id), min=start, count=limit):
            d = {k.decode(): v.decode() for k, v in f.items()}
            out.append(
                {
                    "id": eid.decode(),
                    "type": d["type"],
                    "message": d["message"],
                    "pod_id": d.get("pod_id"),
                    "ts": float(d["ts"]),
                }
            )
        return out
