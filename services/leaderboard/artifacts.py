"""What pods keep in the blob store besides training files (services/contracts/artifacts.py): an
experiment's shared compile caches and each pod's own files (last log lines, TensorBoard files).

Keys, per experiment ``E`` (``podium:lb:E:`` prefix, beside the leaderboard's own):

- ``compile:<key>``: hash ``{sha256, size, holder, facts, published_at}``, the published cache of
  program key ``<key>`` (``sha256`` empty: the first pod compiled nothing worth sharing). The first
  publish wins; a record is replaced only after a pod refused it (corrupt, or not its facts).
- ``compile-claim:<key>``: the pod compiling ``<key>`` now, expiring after the claim's TTL unless
  that pod claims again (a pod that died frees the key for the next one within a TTL).
- ``compile-keys``: set of the experiment's program keys (for ``drop``).
- ``pod-files``: hash ``<pod id>/<name>`` -> JSON ``{sha256, size, uploaded_at}``.

Every blob a record names is counted in the leaderboard's ``podium:blob:refs``, as a
candidate's files are, so the collector keeps it while it is named and collects it once it is
not (replaced, or its experiment dropped). Each change is one Lua script.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from services.checkpoint_store import BlobStore, StagedBlob
from services.contracts.artifacts import CompileCacheState, CompileClaim, PodFile
from services.leaderboard.store import BLOB_GC, BLOB_REFS, PREFIX, LeaderboardStore, new_id
from services.leaderboard.updater import PayloadTooLargeError, hold_for_upload

# Drop one reference to a blob; queue it for collection when none is left.
_DECREF = """
local function decref(refs, gc, sha, now)
  if sha == nil or sha == '' then return end
  local c = redis.call('HINCRBY', refs, sha, -1)
  if c <= 0 then
    redis.call('HDEL', refs, sha)
    redis.call('ZADD', gc, 'NX', now, sha)
  end
end
"""

# KEYS: record claim refs gc waiters; ARGV: pod ttl_ms refused now.
# Returns {state, sha256, size, holder, ttl_ms} and, to a waiting pod, the key's waiters.
CLAIM_LUA = (
    _DECREF
    + """
local rec = redis.call('HMGET', KEYS[1], 'sha256', 'size', 'holder')
if rec[1] and ARGV[3] ~= '' and rec[1] == ARGV[3] then
  redis.call('DEL', KEYS[1])
  decref(KEYS[3], KEYS[4], rec[1], ARGV[4])
  rec = {false, false, false}
end
if rec[1] then return {'ready', rec[1], rec[2], rec[3], 0} end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then
  redis.call('SADD', KEYS[5], ARGV[1])
  redis.call('PEXPIRE', KEYS[5], ARGV[2])
  return {'wait', '', '0', holder, redis.call('PTTL', KEYS[2]), redis.call('SCARD', KEYS[5])}
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return {'compile', '', '0', ARGV[1], ARGV[2]}
"""
)

# KEYS: record claim refs gc keys; ARGV: sha size pod facts now key.
# Returns {1, sha} when this publish is the record, {0, sha} when another one already is.
PUBLISH_LUA = """
local have = redis.call('HGET', KEYS[1], 'sha256')
if have then return {0, have} end
redis.call('HSET', KEYS[1], 'sha256', ARGV[1], 'size', ARGV[2], 'holder', ARGV[3],
           'facts', ARGV[4], 'published_at', ARGV[5])
if ARGV[1] ~= '' then
  redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
  redis.call('ZREM', KEYS[4], ARGV[1])
end
redis.call('SADD', KEYS[5], ARGV[6])
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return {1, ARGV[1]}
"""

# KEYS: pod-files refs gc; ARGV: field entry_json sha now.
PUT_FILE_LUA = (
    _DECREF
    + """
local old = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('ZREM', KEYS[3], ARGV[3])
if old then decref(KEYS[2], KEYS[3], cjson.decode(old)['sha256'], ARGV[4]) end
return 1
"""
)

# KEYS: pod-files compile-keys refs gc; ARGV: compile prefix, claim prefix, now.
DROP_LUA = (
    _DECREF
    + """
for _, entry in ipairs(redis.call('HVALS', KEYS[1])) do
  decref(KEYS[3], KEYS[4], cjson.decode(entry)['sha256'], ARGV[3])
end
for _, key in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  decref(KEYS[3], KEYS[4], redis.call('HGET', ARGV[1] .. key, 'sha256'), ARGV[3])
  redis.call('DEL', ARGV[1] .. key, ARGV[2] .. key)
end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""
)


#: The retry hint of a key's waiters: their claims together about this many a second (a few
#: waiters at most every MIN_RETRY_S each; many, every ``retry_after_s``), before their backoff.
CLAIMS_PER_S = 20.0
MIN_RETRY_S = 0.25


class Keys:
    def __init__(self, experiment_id: str) -> None:
        p = f"{PREFIX}{experiment_id}:"
        self.compile_prefix = p + "compile:"
        self.claim_prefix = p + "compile-claim:"
        self.compile_keys = p + "compile-keys"
        self.pod_files = p + "pod-files"


def _s(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


class ArtifactStore:
    """The records above, on the leaderboard's Redis, and their blobs in its blob store."""

    def __init__(
        self, store: LeaderboardStore, blobs: BlobStore, claim_ttl_s: float, retry_after_s: float
    ) -> None:
        self.store, self.r, self.blobs = store, store.r, blobs
        self.claim_ttl_s, self.retry_after_s = claim_ttl_s, retry_after_s
        self._claim = self.r.register_script(CLAIM_LUA)
        self._publish = self.r.register_script(PUBLISH_LUA)
        self._put_file = self.r.register_script(PUT_FILE_LUA)
        self._drop = self.r.register_script(DROP_LUA)

    # -- compile caches --------------------------------------------------------------------
    async def claim(self, experiment_id: str, key: str, req: CompileClaim) -> CompileCacheState:
        k = Keys(experiment_id)
        waiters = k.claim_prefix + key + ":waiters"
        state, sha, size, holder, ttl_ms, *waiting = await self._claim(
            keys=[k.compile_prefix + key, k.claim_prefix + key, BLOB_REFS, BLOB_GC, waiters],
            args=[req.pod_id, int(self.claim_ttl_s * 1000), req.refused or "", repr(time.time())],
        )
        state = _s(state)
        if state == "ready":
            return CompileCacheState(
                state="ready",
                key=key,
                sha256=_s(sha) or None,
                size=int(_s(size) or 0),
                holder=_s(holder) or None,
            )
        if state == "wait":
            left = max(float(ttl_ms) / 1000, 0.0)
            return CompileCacheState(
                state="wait",
                key=key,
                holder=_s(holder),
                ttl_s=left,
                # A few waiters ask again soon (an eager holder says "nothing" within a second
                # of its claim); many, together about CLAIMS_PER_S times a second.
                retry_after_s=min(
                    self.retry_after_s,
                    max(left, 0.1),
                    max(MIN_RETRY_S, int(waiting[0]) / CLAIMS_PER_S),
                ),
            )
        return CompileCacheState(
            state="compile", key=key, holder=req.pod_id, ttl_s=self.claim_ttl_s
        )

    async def record(self, experiment_id: str, key: str) -> dict[str, str] | None:
        raw = await self.r.hgetall(Keys(experiment_id).compile_prefix + key)
        return {_s(a): _s(b) for a, b in raw.items()} or None

    async def publish(
        self, experiment_id: str, key: str, req: CompileClaim, staged: StagedBlob | None
    ) -> CompileCacheState:
        """Make ``staged`` (None: nothing to share) the key's record, unless one exists; the
        staged file is consumed either way."""
        k = Keys(experiment_id)
        keys = [k.compile_prefix + key, k.claim_prefix + key, BLOB_REFS, BLOB_GC, k.compile_keys]
        facts = req.facts.model_dump_json()

        async def record(sha: str, size: int) -> tuple[int, str]:
            done, have = await self._publish(
                keys=keys, args=[sha, size, req.pod_id, facts, repr(time.time()), key]
            )
            return int(done), _s(have)

        if staged is None:
            await record("", 0)
        elif await self.record(experiment_id, key) is not None:
            await run_in_threadpool(staged.discard)  # published meanwhile: first wins
        else:
            await self._stored(staged, record)
        return await self.claim(experiment_id, key, req.model_copy(update={"refused": None}))

    # -- pods' files -----------------------------------------------------------------------
    async def put_pod_file(
        self, experiment_id: str, pod_id: str, name: str, staged: StagedBlob
    ) -> PodFile:
        entry = PodFile(
            pod_id=pod_id,
            name=name,
            sha256=staged.sha256,
            size=staged.size,
            uploaded_at=time.time(),
        )
        field = f"{pod_id}/{name}"
        payload = entry.model_dump_json(include={"sha256", "size", "uploaded_at"})

        async def record(sha: str, size: int) -> int:
            return await self._put_file(
                keys=[Keys(experiment_id).pod_files, BLOB_REFS, BLOB_GC],
                args=[field, payload, sha, repr(time.time())],
            )

        await self._stored(staged, record)
        return entry

    async def pod_files(self, experiment_id: str) -> list[PodFile]:
        raw = await self.r.hgetall(Keys(experiment_id).pod_files)
        out = []
        for field, value in raw.items():
            pod_id, _, name = _s(field).rpartition("/")
            out.append(PodFile(pod_id=pod_id, name=name, **json.loads(value)))
        return sorted(out, key=lambda f: (f.uploaded_at, f.pod_id, f.name))

    async def pod_file(self, experiment_id: str, pod_id: str, name: str) -> PodFile | None:
        value = await self.r.hget(Keys(experiment_id).pod_files, f"{pod_id}/{name}")
        if value is None:
            return None
        return PodFile(pod_id=pod_id, name=name, **json.loads(value))

    # -- both ------------------------------------------------------------------------------
    async def _stored(
        self, staged: StagedBlob, record: Callable[[str, int], Awaitable[object]]
    ) -> None:
        """Hold the blob (the collector leaves it alone), move it into the store, ``record``
        it (which counts its reference), let go of the hold; the staged file is consumed."""
        holder = new_id("a")
        shas = [staged.sha256]
        held = False
        try:
            await hold_for_upload(self.store, holder, shas)
            held = True
            await run_in_threadpool(self.blobs.commit, staged)
            await record(staged.sha256, staged.size)
        finally:
            await run_in_threadpool(staged.discard)
            if held:
                await self.store.unhold_blobs(holder, shas)

    async def drop(self, experiment_id: str) -> None:
        """Forget the experiment's records; their blobs become collectable."""
        k = Keys(experiment_id)
        await self._drop(
            keys=[k.pod_files, k.compile_keys, BLOB_REFS, BLOB_GC],
            args=[k.compile_prefix, k.claim_prefix, repr(time.time())],
        )


async def stage_body(request: Request, blobs: BlobStore, max_bytes: int) -> StagedBlob:
    """The request's body in a staging file of the blob store, hashed on the way; 413 past
    ``max_bytes`` (nothing kept)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise PayloadTooLargeError(max_bytes)
    writer = await run_in_threadpool(blobs.writer, max_bytes)
    try:
        async for batch in _batches(request.stream()):
            if writer.size + len(batch) > max_bytes:
                raise PayloadTooLargeError(max_bytes)
            await run_in_threadpool(writer.write, batch)
        return await run_in_threadpool(writer.finish)
    except BaseException:
        await run_in_threadpool(writer.abort)
        raise


async def _batches(chunks: AsyncIterator[bytes], size: int = 1 << 20) -> AsyncIterator[bytes]:
    """``chunks`` joined into batches of about ``size`` bytes: one thread hop per batch."""
    buf: list[bytes] = []
    n = 0
    async for chunk in chunks:
        buf.append(chunk)
        n += len(chunk)
        if n >= size:
            yield b"".join(buf)
            buf, n = [], 0
    if buf:
        yield b"".join(buf)
