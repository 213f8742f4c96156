"""The leaderboard's data model in Redis and the Lua scripts that change it atomically.

Keys, per experiment ``E`` (``podium:lb:E:`` prefix):

- ``config``: hash ``{json, top_k, higher_is_better, version, algo:<name>...}``; the set
  ``podium:lb:experiments`` lists E. ``version`` changes with every change to the board.
- ``stats``: hash ``{submissions, env_steps}`` over every decided submission (budgets).
- ``board``: sorted set candidate id -> *rank score* (the score, negated when lower is better,
  so the best is always the highest).
- ``cand:<id>``: hash per candidate (algorithm, hyperparameters, parent, generation, pod id,
  env steps, eval mean/std/episodes, files with sha256, status, timestamps); kept after eviction
  (status ``evicted``) so lineage and history stay readable. ``all`` lists every id.
- ``subs``: hash submission id -> the first answer (idempotent retries).
- ``lineage``: append-only stream (XADD) of every insert, reject, eviction and generator
  decision (fresh / exploit / explore / cem); inserts and rejects carry the submission's pod,
  score, env steps and time, so it is also the log of every decided report.

Blobs (``podium:blob:`` prefix, shared by experiments because blobs are content-addressed):
``refs`` (sha -> number of active candidates using it), ``gc`` (sorted set of unreferenced shas
by the time they became so), ``holds:<sha>`` (sorted set holder -> expiry ms: generator leases
and in-flight uploads), ``deleting`` (shas whose blob the collector is removing).

Every change is one Lua script (a config write one MULTI transaction), so a crash or a
concurrent updater never leaves a partial state: a script runs whole or not at all, and Redis
runs scripts one at a time. The scripts touch keys they derive (candidate hashes, blob holds),
so this layout wants one Redis server (primary/replica is fine), not Redis Cluster.

Why one file of this size: the key layout and the Lua scripts that touch it are one unit
(the invariants above hold only if every script follows the same layout).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

import redis.asyncio
from pydantic import ValidationError

from services.contracts.leaderboard import Experiment
from services.contracts.spec import describe_errors
from services.redis_client import STREAM_ID_MAX

PREFIX = "podium:lb:"
EXPERIMENTS = PREFIX + "experiments"
# Bumped by every change to any board; a board's current value is its config's ``version``,
# so a reader can tell in one round trip whether what it rendered before is still current.
VERSION = PREFIX + "version"
BLOB_REFS = "podium:blob:refs"
BLOB_GC = "podium:blob:gc"
BLOB_DELETING = "podium:blob:deleting"
BLOB_HOLDS = "podium:blob:holds:"
LEASE = "podium:lease:"
# A collector that died mid-delete leaves its mark; after this long an upload may proceed.
DELETING_STALE_MS = 60_000
LAST_STREAM_ID = f"{STREAM_ID_MAX}-{STREAM_ID_MAX}"


class Keys:
    def __init__(self, experiment_id: str):
        p = f"{PREFIX}{experiment_id}:"
        self.config = p + "config"
        self.board = p + "board"
        self.all = p + "all"
        self.subs = p + "subs"
        self.lineage = p + "lineage"
        self.stats = p + "stats"
        self.cand_prefix = p + "cand:"

    def cand(self, candidate_id: str) -> str:
        return self.cand_prefix + candidate_id


# Evict the lowest-ranked candidates until the board holds K; release their blob references.
# Shared by the insert and trim scripts (Lua has no imports, so it is pasted into both).
_EVICT_LUA = """
local function evict_to(board, refs, gc, lineage, cand_prefix, k, sign, now, by)
  local evicted = {}
  while redis.call('ZCARD', board) > k do
    local popped = redis.call('ZPOPMIN', board)
    local ecid = popped[1]
    local ekey = cand_prefix .. ecid
    redis.call('HSET', ekey, 'status', 'evicted', 'evicted_at', now)
    local ef = redis.call('HGET', ekey, 'file_shas')
    if ef then
      for _, sha in ipairs(cjson.decode(ef)) do
        local c = redis.call('HINCRBY', refs, sha, -1)
        if c <= 0 then
          redis.call('HDEL', refs, sha)
          redis.call('ZADD', gc, now, sha)
        end
      end
    end
    redis.call('XADD', lineage, '*', 'event', 'evict', 'candidate_id', ecid,
      'score', tostring(sign * tonumber(popped[2])), 'by', by, 'time', now)
    table.insert(evicted, ecid)
  end
  return evicted
end
"""

# KEYS: config board subs lineage refs gc all stats
# ARGV: submission_id candidate_id score cand_prefix now fields_json shas_json
#       parent_id generation algorithm pod_id env_steps batch_env_steps ('' when not said)
# Returns {code, answer_json}: 0 = the stored answer of an earlier try, 1 = new answer,
# -1 = unknown experiment, -2 = algorithm not in the experiment's ensemble, -3 = parent_id is
# not a candidate of this experiment (another's, or none: its lineage would point outside it).
INSERT_LUA = (
    _EVICT_LUA
    + """
local prior = redis.call('HGET', KEYS[3], ARGV[1])
if prior then return {0, prior} end
local cfg_k = redis.call('HGET', KEYS[1], 'top_k')
if not cfg_k then return {-1, ''} end
if redis.call('HEXISTS', KEYS[1], 'algo:' .. ARGV[10]) == 0 then return {-2, ''} end
if ARGV[8] ~= '' and redis.call('SISMEMBER', KEYS[7], ARGV[8]) == 0 then return {-3, ''} end
local k = tonumber(cfg_k)
-- Every decided submission counts toward the experiment's env-step budget, kept or not.
redis.call('HINCRBY', KEYS[8], 'submissions', 1)
redis.call('HINCRBY', KEYS[8], 'env_steps', ARGV[12])
local sign = 1
if redis.call('HGET', KEYS[1], 'higher_is_better') == '0' then sign = -1 end
local rs = sign * tonumber(ARGV[3])
local cid, now = ARGV[2], ARGV[5]
local shas = cjson.decode(ARGV[7])
if redis.call('ZCARD', KEYS[2]) >= k then
  local worst = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if rs <= tonumber(worst[2]) then
    -- Blobs this submission uploaded that nothing references become collectable.
    for _, sha in ipairs(shas) do
      if not redis.call('HGET', KEYS[5], sha) then redis.call('ZADD', KEYS[6], 'NX', now, sha) end
    end
    local threshold = tostring(sign * tonumber(worst[2]))
    local ans = '{"accepted":false,"reason":' .. cjson.encode(
      'score ' .. ARGV[3] .. ' does not beat the top-' .. k .. ' threshold ' .. threshold) .. '}'
    redis.call('HSET', KEYS[3], ARGV[1], ans)
    redis.call('XADD', KEYS[4], '*', 'event', 'reject', 'submission_id', ARGV[1],
      'score', ARGV[3], 'pod_id', ARGV[11], 'algorithm', ARGV[10], 'env_steps', ARGV[12],
      'batch', ARGV[13], 'parent_id', ARGV[8], 'generation', ARGV[9], 'time', now)
    return {1, ans}
  end
end
local ckey = ARGV[4] .. cid
local flat = {}
for f, v in pairs(cjson.decode(ARGV[6])) do
  flat[#flat + 1] = f
  flat[#flat + 1] = v
end
redis.call('HSET', ckey, 'status', 'active', 'created_at', now, unpack(flat))
redis.call('ZADD', KEYS[2], rs, cid)
redis.call('SADD', KEYS[7], cid)
for _, sha in ipairs(shas) do
  redis.call('HINCRBY', KEYS[5], sha, 1)
  redis.call('ZREM', KEYS[6], sha)
end
redis.call('XADD', KEYS[4], '*', 'event', 'insert', 'candidate_id', cid, 'parent_id', ARGV[8],
  'generation', ARGV[9], 'algorithm', ARGV[10], 'score', ARGV[3], 'submission_id', ARGV[1],
  'pod_id', ARGV[11], 'env_steps', ARGV[12], 'batch', ARGV[13], 'time', now)
local evicted = evict_to(KEYS[2], KEYS[5], KEYS[6], KEYS[4], ARGV[4], k, sign, now, cid)
redis.call('HSET', KEYS[1], 'version', redis.call('INCR', 'podium:lb:version'))
local rank = redis.call('ZREVRANK', KEYS[2], cid) + 1
local ev = '[]'
if #evicted > 0 then ev = cjson.encode(evicted) end
local ans = '{"accepted":true,"candidate_id":' .. cjson.encode(cid) .. ',"rank":' .. rank
  .. ',"evicted":' .. ev .. '}'
redis.call('HSET', KEYS[3], ARGV[1], ans)
return {1, ans}
"""
)

# KEYS: config board refs gc lineage; ARGV: cand_prefix now. Returns evicted ids.
TRIM_LUA = (
    _EVICT_LUA
    + """
local k = tonumber(redis.call('HGET', KEYS[1], 'top_k'))
local sign = 1
if redis.call('HGET', KEYS[1], 'higher_is_better') == '0' then sign = -1 end
redis.call('HSET', KEYS[1], 'version', redis.call('INCR', 'podium:lb:version'))
return evict_to(KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], k, sign, ARGV[2], 'config')
"""
)

# KEYS: config board; ARGV: limit (0 = K) cand_prefix known_version. Returns one JSON document
# {"version": v, "config": "<config json>", "rows": [[id, {field: value}], ...]} best first,
# read atomically; just {"version": v} when the caller already has that version; nil for an
# unknown experiment. One string instead of K x fields bulk replies: parsing a RESP reply field
# by field in Python costs more than the whole request otherwise.
READ_TOP_LUA = """
local cfg = redis.call('HMGET', KEYS[1], 'json', 'top_k', 'version')
if not cfg[1] then return false end
local version = cfg[3] or '0'
if version == ARGV[3] then return '{"version":' .. cjson.encode(version) .. '}' end
local limit = tonumber(ARGV[1])
if limit <= 0 then limit = tonumber(cfg[2]) end
local rows = {}
for _, cid in ipairs(redis.call('ZREVRANGE', KEYS[2], 0, limit - 1)) do
  local flat = redis.call('HGETALL', ARGV[2] .. cid)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  rows[#rows + 1] = {cid, h}
end
if #rows == 0 then
  return '{"version":' .. cjson.encode(version) .. ',"config":' .. cjson.encode(cfg[1])
    .. ',"rows":[]}'
end
return cjson.encode({version = version, config = cfg[1], rows = rows})
"""

# KEYS: board lineage; ARGV: candidate_id lease_id expires_ms now lease_key shas_json
#       pod_id events_json experiment_id
# Leases a parent's blobs to a pod, only if the parent is still on the board, and records the
# generator's decision. Returns 1, or 0 when the parent was evicted meanwhile.
LEASE_LUA = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local shas = cjson.decode(ARGV[6])
for _, sha in ipairs(shas) do
  redis.call('ZADD', 'podium:blob:holds:' .. sha, ARGV[3], ARGV[2])
end
redis.call('HSET', ARGV[5], 'candidate_id', ARGV[1], 'shas', ARGV[6], 'expires_ms', ARGV[3],
  'pod_id', ARGV[7], 'experiment_id', ARGV[9])
redis.call('PEXPIREAT', ARGV[5], ARGV[3])
for _, event in ipairs(cjson.decode(ARGV[8])) do
  local flat = {}
  for _, kv in ipairs(event) do
    flat[#flat + 1] = kv[1]
    flat[#flat + 1] = kv[2]
  end
  redis.call('XADD', KEYS[2], '*', unpack(flat))
end
return 1
"""

# ARGV: lease_key lease_id experiment_id. Returns 1 when released, 0 when unknown, expired or
# another experiment's.
RELEASE_LUA = """
local lease = redis.call('HMGET', ARGV[1], 'shas', 'experiment_id')
local shas = lease[1]
if not shas or lease[2] ~= ARGV[3] then return 0 end
for _, sha in ipairs(cjson.decode(shas)) do
  redis.call('ZREM', 'podium:blob:holds:' .. sha, ARGV[2])
end
redis.call('DEL', ARGV[1])
return 1
"""

# KEYS: deleting; ARGV: holder expires_ms now_ms stale_ms sha... Holds blobs for an upload.
# Returns 0 (nothing held) when the collector is deleting one of them right now: retry shortly.
HOLD_LUA = """
for i = 5, #ARGV do
  local t = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if t and tonumber(t) > tonumber(ARGV[3]) - tonumber(ARGV[4]) then return 0 end
end
for i = 5, #ARGV do
  redis.call('ZADD', 'podium:blob:holds:' .. ARGV[i], ARGV[2], ARGV[1])
end
return 1
"""

# ARGV: holder sha... Releases an upload's holds.
UNHOLD_LUA = """
for i = 2, #ARGV do redis.call('ZREM', 'podium:blob:holds:' .. ARGV[i], ARGV[1]) end
return 1
"""

# KEYS: refs gc deleting holds; ARGV: sha now_ms. The collector claims an unreferenced,
# unheld blob: 1 = delete it now (then call DONE), 0 = keep it.
GC_CLAIM_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[2])
if redis.call('ZCARD', KEYS[4]) > 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
return 1
"""

# KEYS: config board all subs lineage refs gc stats; ARGV: cand_prefix now experiment_id
# Drops an experiment; its candidates' blobs become collectable (leases still protect them).
DROP_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for _, cid in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local ef = redis.call('HGET', ARGV[1] .. cid, 'file_shas')
  if ef then
    for _, sha in ipairs(cjson.decode(ef)) do
      local c = redis.call('HINCRBY', KEYS[6], sha, -1)
      if c <= 0 then
        redis.call('HDEL', KEYS[6], sha)
        redis.call('ZADD', KEYS[7], ARGV[2], sha)
      end
    end
  end
end
for _, cid in ipairs(redis.call('SMEMBERS', KEYS[3])) do redis.call('DEL', ARGV[1] .. cid) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[8])
redis.call('SREM', 'podium:lb:experiments', ARGV[3])
return 1
"""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:20]}"


class UnknownExperimentError(LookupError):
    pass


class InvalidConfigError(Exception):
    """409: an experiment's stored configuration no longer validates (written by an older
    version, or naming a plugin since uninstalled). Only that experiment is affected; a PUT of
    a corrected configuration, or a DELETE, mends it."""

    def __init__(self, experiment_id: str, problems: list[str]):
        self.experiment_id = experiment_id
        super().__init__(
            f"the stored configuration of experiment {experiment_id!r} is invalid "
            f"({'; '.join(problems)}); PUT a corrected one or DELETE the experiment"
        )


def parse_experiment(experiment_id: str, raw: dict[str, Any]) -> Experiment:
    """The stored configuration as a model; InvalidConfigError (409) when it no longer
    validates, so one bad record never turns into a 500."""
    try:
        return Experiment.model_validate(raw)
    except ValidationError as e:
        raise InvalidConfigError(experiment_id, [ln.strip() for ln in describe_errors(e)]) from e


class StoreBusyError(Exception):
    """503: a transient conflict (a blob being collected, parents evicted under the generator)."""


class FieldError(ValueError):
    """A field that validates on its own but not against the stored state (422 naming it)."""

    def __init__(self, message: str, loc: tuple[str, ...]):
        super().__init__(message)
        self.loc = loc


class UnknownAlgorithmError(FieldError):
    """A result or request names an algorithm outside the experiment's ensemble (422)."""

    def __init__(self, message: str, loc: tuple[str, ...] = ("body", "algorithm")):
        super().__init__(message, loc)


class UnknownParentError(FieldError):
    """A result's ``parent_id`` is not a candidate of its experiment (422)."""


class LeaderboardStore:
    """Async access to the leaderboard's Redis data; each method is one atomic step."""

    def __init__(self, client: redis.asyncio.Redis):
        self.r = client
        self._insert = client.register_script(INSERT_LUA)
        self._trim = client.register_script(TRIM_LUA)
        self._read_top = client.register_script(READ_TOP_LUA)
        self._lease = client.register_script(LEASE_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._hold = client.register_script(HOLD_LUA)
        self._unhold = client.register_script(UNHOLD_LUA)
        self._gc_claim = client.register_script(GC_CLAIM_LUA)
        self._drop = client.register_script(DROP_LUA)

    # -- experiments -------------------------------------------------------------------------

    async def put_config(
        self,
        experiment_id: str,
        config_json: str,
        top_k: int,
        higher_is_better: bool,
        algorithms: list[str],
    ) -> tuple[bool, list[str]]:
        """Create or update; returns (created, ids evicted because K shrank)."""
        k = Keys(experiment_id)
        async with self.r.pipeline(transaction=True) as p:
            p.sadd(EXPERIMENTS, experiment_id)
            p.delete(k.config)  # drops algorithms no longer listed
            p.hset(
                k.config,
                mapping={
                    "json": config_json,
                    "top_k": top_k,
                    "higher_is_better": "1" if higher_is_better else "0",
                    # The insert script checks a result's algorithm against these.
                    **{f"algo:{a}": 1 for a in algorithms},
                },
            )
            created = (await p.execute())[0] == 1
        evicted = await self._trim(
            keys=[k.config, k.board, BLOB_REFS, BLOB_GC, k.lineage],
            args=[k.cand_prefix, repr(time.time())],
        )
        return created, [_s(e) for e in evicted]

    async def get_config(self, experiment_id: str) -> dict[str, Any]:
        raw = await self.r.hget(Keys(experiment_id).config, "json")
        if raw is None:
            raise UnknownExperimentError(experiment_id)
        return json.loads(raw)

    async def summary(self, experiment_id: str) -> dict[str, Any]:
        """Config plus board size and totals over every decided submission."""
        k = Keys(experiment_id)
        async with self.r.pipeline(transaction=True) as p:
            p.hget(k.config, "json")
            p.zcard(k.board)
            p.hgetall(k.stats)
            raw, size, stats = await p.execute()
        if raw is None:
            raise UnknownExperimentError(experiment_id)
        stats = {_s(a): int(b) for a, b in stats.items()}
        return {
            **json.loads(raw),
            "size": size,
            "submissions": stats.get("submissions", 0),
            "env_steps": stats.get("env_steps", 0),
        }

    async def board_size(self, experiment_id: str) -> int:
        return await self.r.zcard(Keys(experiment_id).board)

    async def experiments(self) -> list[str]:
        return sorted(_s(e) for e in await self.r.smembers(EXPERIMENTS))

    async def drop(self, experiment_id: str) -> bool:
        k = Keys(experiment_id)
        done = await self._drop(
            keys=[k.config, k.board, k.all, k.subs, k.lineage, BLOB_REFS, BLOB_GC, k.stats],
            args=[k.cand_prefix, repr(time.time()), experiment_id],
        )
        return bool(done)

    # -- updater -----------------------------------------------------------------------------

    async def insert(
        self,
        experiment_id: str,
        *,
        submission_id: str,
        score: float,
        fields: dict[str, str],
        shas: list[str],
        parent_id: str | None,
        generation: int,
        algorithm: str,
        pod_id: str,
        env_steps: int = 0,
        batch_env_steps: int | None = None,
    ) -> tuple[bool, dict[str, Any]]:
        """Insert if in the top K (evicting the worst). Returns (is_retry, answer)."""
        if not math.isfinite(score):
            raise ValueError("score must be finite")
        k = Keys(experiment_id)
        code, answer = await self._insert(
            keys=[k.config, k.board, k.subs, k.lineage, BLOB_REFS, BLOB_GC, k.all, k.stats],
            args=[
                submission_id,
                new_id("c"),
                repr(float(score)),
                k.cand_prefix,
                repr(time.time()),
                json.dumps(fields),
                json.dumps(shas),
                parent_id or "",
                generation,
                algorithm,
                pod_id,
                env_steps,
                "" if batch_env_steps is None else batch_env_steps,
            ],
        )
        if code == -1:
            raise UnknownExperimentError(experiment_id)
        if code == -2:
            raise UnknownAlgorithmError(
                f"algorithm {algorithm!r} is not in experiment {experiment_id!r}'s ensemble",
                ("body", "result", "algorithm"),
            )
        if code == -3:
            raise UnknownParentError(
                f"parent_id {parent_id!r} is not a candidate of experiment {experiment_id!r}: a "
                "pod's parent is a candidate the leaderboard generated for this experiment",
                ("body", "result", "parent_id"),
            )
        return code == 0, json.loads(answer)

    # -- read side ---------------------------------------------------------------------------

    async def top(
        self, experiment_id: str, limit: int = 0
    ) -> tuple[dict[str, Any], list[tuple[str, dict[str, str]]]]:
        """The config and the best ``limit`` candidates (0: K), read atomically."""
        _, config, rows = await self.top_if_changed(experiment_id, limit, "")
        assert config is not None and rows is not None
        return config, rows

    async def top_if_changed(
        self, experiment_id: str, limit: int, known_version: str
    ) -> tuple[str, dict[str, Any] | None, list[tuple[str, dict[str, str]]] | None]:
        """Like ``top``, but (version, None, None) when the board is still at ``known_version``."""
        k = Keys(experiment_id)
        raw = await self._read_top(
            keys=[k.config, k.board], args=[limit, k.cand_prefix, known_version]
        )
        if raw is None:
            raise UnknownExperimentError(experiment_id)
        doc = json.loads(raw)
        if "config" not in doc:
            return doc["version"], None, None
        rows = [(cid, h) for cid, h in doc["rows"]]
        return doc["version"], json.loads(doc["config"]), rows

    async def candidate(self, experiment_id: str, candidate_id: str) -> dict[str, str] | None:
        k = Keys(experiment_id)
        async with self.r.pipeline(transaction=False) as p:
            p.hgetall(k.cand(candidate_id))
            p.zrevrank(k.board, candidate_id)
            raw, rank = await p.execute()
        if not raw:
            return None
        out = {_s(a): _s(b) for a, b in raw.items()}
        out["rank"] = "" if rank is None else str(rank + 1)
        return out

    async def lineage_events(self, experiment_id: str) -> list[dict[str, str]]:
        return [e for _, e in await self.lineage_page(experiment_id, None, None)]

    async def lineage_page(
        self, experiment_id: str, after: str | None, count: int | None
    ) -> list[tuple[str, dict[str, str]]]:
        """Up to ``count`` (None: all) lineage entries (stream id, fields) after the entry
        ``after``."""
        if after == LAST_STREAM_ID:  # nothing can follow it (Redis refuses the interval)
            return []
        entries = await self.r.xrange(
            Keys(experiment_id).lineage, min=f"({after}" if after else "-", count=count
        )
        return [(_s(i), {_s(a): _s(b) for a, b in fields.items()}) for i, fields in entries]

    async def lease(
        self,
        experiment_id: str,
        candidate_id: str,
        shas: list[str],
        pod_id: str,
        ttl_s: float,
        events: list[list[tuple[str, str]]],
    ) -> tuple[str, float] | None:
        """Protect a parent's blobs for a pod and log the decision; None if it was evicted."""
        k = Keys(experiment_id)
        lease_id = new_id("l")
        expires = time.time() + ttl_s
        ok = await self._lease(
            keys=[k.board, k.lineage],
            args=[
                candidate_id,
                lease_id,
                int(expires * 1000),
                repr(time.time()),
                LEASE + lease_id,
                json.dumps(sorted(set(shas))),
                pod_id,
                json.dumps(events),
                experiment_id,
            ],
        )
        return (lease_id, expires) if ok else None

    async def log_event(self, experiment_id: str, fields: dict[str, str]) -> None:
        await self.r.xadd(Keys(experiment_id).lineage, fields)

    async def release(self, experiment_id: str, lease_id: str) -> bool:
        return bool(await self._release(args=[LEASE + lease_id, lease_id, experiment_id]))

    # -- blobs -------------------------------------------------------------------------------

    async def hold_blobs(self, holder: str, shas: list[str], ttl_s: float) -> bool:
        now_ms = int(time.time() * 1000)
        return bool(
            await self._hold(
                keys=[BLOB_DELETING],
                args=[holder, now_ms + int(ttl_s * 1000), now_ms, DELETING_STALE_MS, *shas],
            )
        )

    async def unhold_blobs(self, holder: str, shas: list[str]) -> None:
        await self._unhold(args=[holder, *shas])

    async def gc_candidates(self, older_than: float) -> list[str]:
        return [_s(s) for s in await self.r.zrangebyscore(BLOB_GC, "-inf", older_than)]

    async def gc_claim(self, sha: str) -> bool:
        return bool(
            await self._gc_claim(
                keys=[BLOB_REFS, BLOB_GC, BLOB_DELETING, BLOB_HOLDS + sha],
                args=[sha, int(time.time() * 1000)],
            )
        )

    async def gc_done(self, sha: str) -> None:
        await self.r.zrem(BLOB_DELETING, sha)

    async def mark_orphans(self, shas: list[str]) -> int:
        """Queue blobs found in storage that no candidate references (swept uploads)."""
        if not shas:
            return 0
        refs = await self.r.hmget(BLOB_REFS, shas)
        orphans = [s for s, c in zip(shas, refs, strict=True) if c is None]
        if orphans:
            await self.r.zadd(BLOB_GC, dict.fromkeys(orphans, time.time()), nx=True)
        return len(orphans)
