"""Experiment state and events in Redis: the reconciler's desired state and its status.

Keys (prefix ``podium:orch:``):

- ``experiments``: sorted set id → creation time (every experiment; pages of the list).
- ``state:<state>``: sorted set id → creation time, one per state (the list filtered by state,
  and the per-state gauges, without reading every record).
- ``active``: set of the ids the reconciler still has work for (not yet ended and finalized,
  or being deleted); a pass reads these only, so finished experiments cost it nothing.
- ``exp:<id>``: hash with ``spec`` (JSON), ``created_at``, ``intent`` (written only by the API:
  run / pause / cancel / delete), ``status`` (JSON), ``state`` and ``launched`` (the count of
  ``launched:<id>``, kept with it; written only by the reconciler) and ``idem`` (the
  idempotency key that created it, if any), so the two writers never overwrite each other's
  fields.
- ``events:<id>``: stream of events (pod started / failed / replaced, scaled, target reached…).
- ``handled:<id>``: set of finished pods already accounted for (idempotent across restarts).
- ``launched:<id>``: set of the pods recorded as launched (each with its start event and the
  ``launched`` count, written together), so a restarted orchestrator records a pod it adopts
  that its predecessor started but did not get to record, and never one twice.
- ``podlogs:<id>``: hash pod id → an ended pod's last log lines (``EndedPodLog`` JSON), and
  ``podlogs_order:<id>``: sorted set pod id → when it ended; the newest few only (a bound the
  reconciler passes), deleted with the experiment. The backend forgets an ended pod (a
  Kubernetes pod's log goes with its object), so these are what ``podium logs`` shows then.
- ``idem:<key>``: idempotency key → experiment id and request hash (24 h; freed when the
  experiment is deleted, see docs/orchestrator.md).

Every write that depends on what is stored (create, intent changes, status writes, delete) is
one Lua script, so concurrent requests and the reconciler cannot interleave: an accepted cancel
is final, and an ended experiment stays ended.

A stored record that no longer validates (written by an older version, or edited by hand) is
read as an ``Experiment`` with ``invalid`` set to the reason instead of raising, so it cannot
take down a list, a reconcile pass or other experiments; it can still be deleted.

Why one file of this size: the Redis layout and the Lua scripts that change it state the
store's invariants (atomic transitions, final terminal states, indexes); split apart, a
reader could no longer check one against the other.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis
from pydantic import ValidationError

from services.contracts.spec import ExperimentSpec, describe_errors
from services.orchestrator.status import EndedPodLog, ExperimentStatus

PREFIX = "podium:orch:"
EVENTS_MAXLEN = 10_000
IDEMPOTENCY_TTL_S = 24 * 3600
#: Parsed specs kept in memory (by id, checked against the stored bytes on every read).
SPEC_CACHE_SIZE = 4096
#: Records read in one pipeline round trip.
GET_CHUNK = 500
#: Records one page of ``?state=invalid`` looks through at most.
INVALID_SCAN = 2_000
#: Bumped when the secondary keys (state:<state>, active) change shape: rebuilt at start-up.
INDEX_VERSION = "1"

PENDING, RUNNING, PAUSED = "pending", "running", "paused"
SUCCEEDED, FAILED, CANCELLED, BUDGET_EXHAUSTED = (
    "succeeded",
    "failed",
    "cancelled",
    "budget_exhausted",
)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, BUDGET_EXHAUSTED})
STATES = (PENDING, RUNNING, PAUSED, SUCCEEDED, FAILED, CANCELLED, BUDGET_EXHAUSTED)
#: Shown for a stored record that no longer validates (never stored as a state).
INVALID = "invalid"

RUN, PAUSE, CANCEL, DELETE = "run", "pause", "cancel", "delete"

# Lua: the terminal states, for the scripts below.
_TERMINAL_LUA = "{" + ", ".join(f"{s}=true" for s in sorted(TERMINAL)) + "}"


@dataclass
class Experiment:
    id: str
    spec: ExperimentSpec | None  # None when ``invalid``
    created_at: float
    intent: str
    status: ExperimentStatus = field(default_factory=ExperimentStatus)
    invalid: str | None = None  # why the stored record does not validate
    #: Pods launched as recorded with each launch (``Store.pod_launched``): never behind, as
    #: ``status.pods_launched`` is when a pass died before saving it; 0 before any.
    launched: int = 0

    @property
    def state(self) -> str:
        return self.status.state

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


class IdempotencyConflictError(Exception):
    """The idempotency key was used before with a different request body."""


class TransitionError(Exception):
    """An intent the experiment's stored state refuses; ``args[0]`` says why (for a 409)."""


class NotFoundError(LookupError):
    """No such experiment (or it is being deleted)."""


@dataclass(frozen=True)
class Cursor:
    """Where a page of the list ended: the last item's creation time and id (newest first)."""

    created_at: float
    id: str

    def encode(self) -> str:
        return f"{self.created_at!r}:{self.id}"

    @classmethod
    def decode(cls, text: str) -> Cursor:
        created, sep, exp_id = text.partition(":")
        try:
            value = float(created)
        except ValueError:
            value = math.nan
        if not sep or not exp_id or not math.isfinite(value):
            raise ValueError("not a cursor from this API (use the X-Next-Cursor header)")
        return cls(value, exp_id)


class Store:
    def __init__(self, r: redis.Redis):
        self.r = r
        self._create = r.register_script(self._CREATE_LUA)
        self._intent = r.register_script(self._INTENT_LUA)
        self._status = r.register_script(self._STATUS_LUA)
        self._delete = r.register_script(self._DELETE_LUA)
        self._keep_log = r.register_script(self._KEEP_LOG_LUA)
        self._launched = r.register_script(self._LAUNCHED_LUA)
        self._specs: OrderedDict[str, tuple[bytes, ExperimentSpec | str]] = OrderedDict()
        self._specs_lock = threading.Lock()

    def _k(self, *parts: str) -> str:
        return PREFIX + ":".join(parts)

    # KEYS: exp experiments idem state:pending active
    # ARGV: id body_hash ttl (0: no key) spec created_at intent status idem_key
    # Returns the key's earlier value (a replay) or nil (created).
    _CREATE_LUA = """
if tonumber(ARGV[3]) > 0 then
  local prior = redis.call('GET', KEYS[3])
  if prior then return prior end
  redis.call('SET', KEYS[3], ARGV[1] .. ' ' .. ARGV[2], 'EX', ARGV[3])
end
redis.call('HSET', KEYS[1], 'spec', ARGV[4], 'created_at', ARGV[5], 'intent', ARGV[6],
  'status', ARGV[7], 'state', 'pending', 'idem', ARGV[8])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
return false
"""

    # The stored state, also of records written before the ``state`` field existed.
    _STATE_OF_LUA = """
local function state_of(key)
  local s = redis.call('HGET', key, 'state')
  if s then return s end
  local ok, status = pcall(cjson.decode, redis.call('HGET', key, 'status') or '{}')
  if ok and type(status) == 'table' and type(status.state) == 'string' then
    return status.state
  end
  return 'pending'
end
-- The idempotency key that created the experiment is freed with it (if it still names it):
-- a new request with that key creates a new experiment.
local function free_key(key, idem_prefix, id)
  local idem = redis.call('HGET', key, 'idem')
  if idem and idem ~= '' then
    local v = redis.call('GET', idem_prefix .. idem)
    if v and string.sub(v, 1, string.len(id) + 1) == id .. ' ' then
      redis.call('DEL', idem_prefix .. idem)
    end
  end
end
"""

    # KEYS: exp active; ARGV: intent idem_prefix id.
    # Returns 'ok', 'missing', 'cancelled' or 'ended:<state>'.
    _INTENT_LUA = (
        _STATE_OF_LUA
        + f"local terminal = {_TERMINAL_LUA}\n"
        + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
local current = redis.call('HGET', KEYS[1], 'intent') or 'run'
if current == 'delete' then return 'missing' end
local want = ARGV[1]
if want == 'delete' then
  redis.call('HSET', KEYS[1], 'intent', 'delete')
  redis.call('SADD', KEYS[2], ARGV[3])
  free_key(KEYS[1], ARGV[2], ARGV[3])
  return 'ok'
end
local state = state_of(KEYS[1])
if current == 'cancel' then
  if want == 'cancel' then return 'ok' end
  return 'cancelled'
end
if terminal[state] then return 'ended:' .. state end
redis.call('HSET', KEYS[1], 'intent', want)
return 'ok'
"""
    )

    # KEYS: exp active state_prefix; ARGV: id status state done.
    # Returns 1 (written), 0 (no such experiment) or -1 (it has ended: a terminal state is final).
    _STATUS_LUA = (
        _STATE_OF_LUA
        + f"local terminal = {_TERMINAL_LUA}\n"
        + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local old = state_of(KEYS[1])
-- Final, except that an end by budget becomes success when the final reports (they come
-- in after the end) show the target was met.
if terminal[old] and old ~= ARGV[3] and not (old == 'budget_exhausted' and ARGV[3] == 'succeeded')
then return -1 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'state', ARGV[3])
if old ~= ARGV[3] then
  redis.call('ZREM', KEYS[3] .. old, ARGV[1])
end
redis.call('ZADD', KEYS[3] .. ARGV[3], redis.call('HGET', KEYS[1], 'created_at') or 0, ARGV[1])
if ARGV[4] == '1' and redis.call('HGET', KEYS[1], 'intent') ~= 'delete' then
  redis.call('SREM', KEYS[2], ARGV[1])
end
return 1
"""
    )

    # KEYS: exp events handled experiments active idem_prefix state_prefix podlogs
    # podlogs_order launched; ARGV: id.
    _DELETE_LUA = (
        _STATE_OF_LUA
        + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local state = state_of(KEYS[1])
  redis.call('ZREM', KEYS[7] .. state, ARGV[1])
  free_key(KEYS[1], KEYS[6], ARGV[1])
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[8], KEYS[9], KEYS[10])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
return 1
"""
    )

    # KEYS: exp podlogs podlogs_order; ARGV: pod_id ended_at record keep.
    # Kept only while the experiment exists (a pod handed in as it is deleted leaves nothing
    # behind); then the oldest beyond ``keep`` are dropped. Returns 1 (kept) or 0.
    _KEEP_LOG_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
local extra = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[4])
if extra > 0 then
  local old = redis.call('ZRANGE', KEYS[3], 0, extra - 1)
  redis.call('ZREMRANGEBYRANK', KEYS[3], 0, extra - 1)
  redis.call('HDEL', KEYS[2], unpack(old))
end
return 1
"""

    # KEYS: exp launched events; ARGV: pod_id type message ts maxlen.
    # A pod's launch is recorded once, with its event and the count, together (a crash
    # between them would leave a launch without its event, or an event written twice): 1 the
    # first time, 0 once recorded (or when the experiment is gone: nothing is written then).
    # The count starts at the stored status's (an experiment from before it was kept).
    _LAUNCHED_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
if redis.call('HEXISTS', KEYS[1], 'launched') == 0 then
  local ok, status = pcall(cjson.decode, redis.call('HGET', KEYS[1], 'status') or '{}')
  local base = 0
  if ok and type(status) == 'table' and type(status.pods_launched) == 'number' then
    base = status.pods_launched
  end
  redis.call('HSET', KEYS[1], 'launched', base)
end
redis.call('HINCRBY', KEYS[1], 'launched', 1)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*',
  'type', ARGV[2], 'message', ARGV[3], 'ts', ARGV[4], 'pod_id', ARGV[1])
return 1
"""

    # -- start-up ----------------------------------------------------------------------------
    def migrate(self) -> None:
        """Build the secondary keys (per-state sets, active set) for records written before
        they existed; a no-op once done for this ``INDEX_VERSION``."""
        if self.r.get(self._k("index_version")) == INDEX_VERSION.encode():
            return
        for exp in self.get_many(self.ids()):
            state = exp.state
            pipe = self.r.pipeline()
            pipe.hset(self._k("exp", exp.id), "state", state)
            pipe.zadd(self._k("state", state), {exp.id: exp.created_at})
            if not (exp.terminal and exp.status.finalized) or exp.intent == DELETE:
                pipe.sadd(self._k("active"), exp.id)
            pipe.execute()
        self.r.set(self._k("index_version"), INDEX_VERSION)

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
        status = ExperimentStatus(
            state=PENDING, reason="waiting for the reconciler", pods_launched=0
        )
        fields = [spec.model_dump_json(), now, RUN, status.to_json()]
        keys = [self._k("exp", exp_id), self._k("experiments")]
        tail = [self._k("state", PENDING), self._k("active")]
        if not idempotency_key:
            self._create(
                keys=[*keys, self._k("idem", "-"), *tail], args=[exp_id, "", 0, *fields, ""]
            )
            return exp_id, True
        prior = self._create(
            keys=[*keys, self._k("idem", idempotency_key), *tail],
            args=[exp_id, body_hash, IDEMPOTENCY_TTL_S, *fields, idempotency_key],
        )
        if prior is None:
            return exp_id, True
        old_id, _, old_hash = prior.decode().partition(" ")
        if old_hash != body_hash:
            raise IdempotencyConflictError(old_id)
        return old_id, False

    def _spec(self, exp_id: str, raw: bytes) -> ExperimentSpec | str:
        """The parsed spec, or why it does not validate; parsed once per stored value."""
        with self._specs_lock:
            hit = self._specs.get(exp_id)
            if hit is not None and hit[0] == raw:
                self._specs.move_to_end(exp_id)
                return hit[1]
        parsed: ExperimentSpec | str
        try:
            parsed = ExperimentSpec.model_validate_json(raw)
        except ValidationError as e:
            parsed = "stored spec no longer validates:" + ";".join(describe_errors(e))
        with self._specs_lock:
            self._specs[exp_id] = (raw, parsed)
            self._specs.move_to_end(exp_id)
            while len(self._specs) > SPEC_CACHE_SIZE:
                self._specs.popitem(last=False)
        return parsed

    def _decode(self, exp_id: str, h: dict[bytes, bytes]) -> Experiment | None:
        if not h or b"spec" not in h:
            return None
        intent = h.get(b"intent", b"run").decode(errors="replace")
        problems = []
        try:
            created_at = float(h[b"created_at"])
        except (KeyError, ValueError):
            created_at, _ = 0.0, problems.append("created_at is not a number")
        try:
            status = ExperimentStatus.model_validate_json(h.get(b"status", b"{}"))
        except ValidationError as e:
            status = ExperimentStatus()
            problems.append("status is not valid:" + ";".join(describe_errors(e)))
        spec = self._spec(exp_id, h[b"spec"])
        if isinstance(spec, str):
            problems.append(spec)
            spec = None
        try:
            launched = int(h.get(b"launched", b"0"))
        except ValueError:
            launched = 0  # only ever written by pod_launched: not worth refusing the record
        return Experiment(
            id=exp_id,
            spec=spec,
            created_at=created_at,
            intent=intent,
            status=status,
            invalid="; ".join(problems) or None,
            launched=launched,
        )

    def get(self, exp_id: str) -> Experiment | None:
        return self._decode(exp_id, self.r.hgetall(self._k("exp", exp_id)))

    def get_many(self, ids: Iterable[str]) -> list[Experiment]:
        """The stored experiments among ``ids``, in that order (one round trip)."""
        ids = list(ids)
        out = []
        for start in range(0, len(ids), GET_CHUNK):  # bounded replies, also for a migration
            chunk = ids[start : start + GET_CHUNK]
            pipe = self.r.pipeline(transaction=False)
            for i in chunk:
                pipe.hgetall(self._k("exp", i))
            for i, h in zip(chunk, pipe.execute(), strict=True):
                exp = self._decode(i, h)
                if exp is not None:
                    out.append(exp)
        return out

    def ids(self) -> list[str]:
        return [i.decode() for i in self.r.zrange(self._k("experiments"), 0, -1)]

    def list(self) -> list[Experiment]:
        """Every stored experiment, oldest first (tests and tools; the API pages)."""
        return self.get_many(self.ids())

    def active(self) -> list[Experiment]:
        """The experiments the reconciler still has work for, oldest first."""
        ids = [i.decode() for i in self.r.smembers(self._k("active"))]
        exps = self.get_many(ids)
        return sorted(exps, key=lambda e: (e.created_at, e.id))

    def is_active(self, exp_id: str) -> bool:
        return bool(self.r.sismember(self._k("active"), exp_id))

    def page(
        self, limit: int, cursor: Cursor | None = None, state: str | None = None
    ) -> tuple[list[Experiment], Cursor | None]:
        """Up to ``limit`` experiments, newest first, after ``cursor``; and the next cursor.

        Being deleted ones are left out; a state's page shows only records that validate.
        Reads a sorted-set range and the page's records only, except for ``invalid`` (shown,
        never stored as a state): those are looked for among every experiment, at most
        ``INVALID_SCAN`` records a page, so a page may be short and still have a next cursor.
        """
        invalid = state == INVALID
        key = self._k("state", state) if state and not invalid else self._k("experiments")
        top: float | str = "+inf" if cursor is None else cursor.created_at
        out: list[Experiment] = []
        offset, last = 0, None
        while len(out) <= limit:
            need = limit + 1 - len(out)
            if invalid:
                if offset >= INVALID_SCAN:
                    return out, last
                need = max(need, min(GET_CHUNK, INVALID_SCAN - offset))
            rows = self.r.zrange(
                key, top, "-inf", byscore=True, desc=True, offset=offset, num=need, withscores=True
            )
            offset += len(rows)
            # The range starts at the cursor's time inclusive; same-time ids come in
            # descending order, so those at or above the cursor's id were on earlier pages.
            ids = [
                m.decode()
                for m, score in rows
                if cursor is None or score < cursor.created_at or m.decode() < cursor.id
            ]
            out.extend(
                e
                for e in self.get_many(ids)
                if e.intent != DELETE and (state is None or (e.invalid is not None) == invalid)
            )
            if rows:  # where a page cut short by the scan's bound goes on
                last = Cursor(rows[-1][1], rows[-1][0].decode())
            if len(rows) < need:
                break
        more = len(out) > limit
        out = out[:limit]
        return out, (Cursor(out[-1].created_at, out[-1].id) if more else None)

    def state_counts(self) -> dict[str, int]:
        pipe = self.r.pipeline(transaction=False)
        for s in STATES:
            pipe.zcard(self._k("state", s))
        return dict(zip(STATES, pipe.execute(), strict=True))

    def set_intent(self, exp_id: str, intent: str) -> None:
        """Atomically, against what is stored: raises NotFoundError (no such experiment, or
        being deleted) or TransitionError (cancelled, or ended) instead of undoing either."""
        answer = self._intent(
            keys=[self._k("exp", exp_id), self._k("active")],
            args=[intent, self._k("idem", ""), exp_id],
        ).decode()
        if answer == "missing":
            raise NotFoundError(exp_id)
        if answer == "cancelled":
            raise TransitionError("experiment was cancelled")
        if answer.startswith("ended:"):
            raise TransitionError(f"experiment has already ended ({answer[6:]})")

    def set_status(self, exp_id: str, status: ExperimentStatus) -> bool:
        """Write the reconciler's status; False when the experiment is gone or had already
        ended in another state (a terminal state is final; the write is refused)."""
        state = status.state
        done = state in TERMINAL and status.finalized
        written = self._status(
            keys=[self._k("exp", exp_id), self._k("active"), self._k("state", "")],
            args=[exp_id, status.to_json(), state, "1" if done else "0"],
        )
        return written == 1

    def delete(self, exp_id: str) -> None:
        self._delete(
            keys=[
                self._k("exp", exp_id),
                self._k("events", exp_id),
                self._k("handled", exp_id),
                self._k("experiments"),
                self._k("active"),
                self._k("idem", ""),
                self._k("state", ""),
                self._k("podlogs", exp_id),
                self._k("podlogs_order", exp_id),
                self._k("launched", exp_id),
            ],
            args=[exp_id],
        )
        with self._specs_lock:
            self._specs.pop(exp_id, None)

    # -- launched pods -----------------------------------------------------------------------
    def pod_launched(self, exp_id: str, pod_id: str, type_: str, message: str) -> bool:
        """Record that a pod of the experiment was launched, with its event (``type_``,
        ``message``): True the first time, False when it was recorded already (the event is
        not written again) or the experiment is gone. A restarted orchestrator records the pods
        it adopts with this, so a pod its predecessor started but died before recording is
        counted and has its event, and one it did record is not counted twice."""
        keys = [self._k("exp", exp_id), self._k("launched", exp_id), self._k("events", exp_id)]
        args = [pod_id, type_, message, repr(time.time()), EVENTS_MAXLEN]
        return self._launched(keys=keys, args=args) == 1

    # -- finished pods -----------------------------------------------------------------------
    def mark_handled(self, exp_id: str, pod_id: str) -> bool:
        """True the first time a finished pod is handed in (so it is counted exactly once)."""
        return bool(self.r.sadd(self._k("handled", exp_id), pod_id))

    def handled(self, exp_id: str, pod_id: str) -> bool:
        """Whether a finished pod was handed in already (``mark_handled``)."""
        return bool(self.r.sismember(self._k("handled", exp_id), pod_id))

    # -- ended pods' logs -------------------------------------------------------------------
    def keep_pod_log(self, exp_id: str, record: EndedPodLog, keep: int) -> bool:
        """Keep an ended pod's last log lines with its experiment (the newest ``keep`` pods'
        only); False when the experiment is gone."""
        keys = [
            self._k("exp", exp_id),
            self._k("podlogs", exp_id),
            self._k("podlogs_order", exp_id),
        ]
        args = [record.pod_id, repr(record.ended_at), record.model_dump_json(), keep]
        return self._keep_log(keys=keys, args=args) == 1

    def pod_logs(self, exp_id: str) -> list[EndedPodLog]:
        """The kept logs of an experiment's ended pods, in the order they ended."""
        order = [m.decode() for m in self.r.zrange(self._k("podlogs_order", exp_id), 0, -1)]
        if not order:
            return []
        raw = self.r.hmget(self._k("podlogs", exp_id), order)
        logs = (self._pod_log(v) for v in raw if v is not None)
        return [x for x in logs if x is not None]

    def pod_log(self, exp_id: str, pod_id: str) -> EndedPodLog | None:
        raw = self.r.hget(self._k("podlogs", exp_id), pod_id)
        return None if raw is None else self._pod_log(raw)

    @staticmethod
    def _pod_log(raw: bytes) -> EndedPodLog | None:
        try:
            return EndedPodLog.model_validate_json(raw)
        except ValidationError:
            return None  # written by a version that stored something else: not shown

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
