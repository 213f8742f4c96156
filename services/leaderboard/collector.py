"""The blob collector: deletes training files that no candidate references any more.

A blob becomes a candidate for collection when its last referencing candidate is evicted (or
its experiment dropped), or when it was uploaded for a submission that was then rejected. It is
deleted only when, atomically in Redis, nothing references it *and* nobody holds it: a pod that
got it as its parent from the generator holds a lease until it releases it or the lease expires,
and an upload in flight holds it until its submission is decided. While deleting, the blob is
marked so a concurrent upload of the same bytes waits instead of losing its file.

``sweep`` also finds blobs in storage that Redis never heard of (an upload interrupted between
storing its files and the decision) once they are older than a grace period.
"""

from __future__ import annotations

import asyncio
import time

from starlette.concurrency import run_in_threadpool

from services.checkpoint_store import STAGING_MAX_AGE_S, BlobStore
from services.leaderboard.store import LeaderboardStore
from services.logs import get_logger

log = get_logger(__name__)


class BlobCollector:
    def __init__(self, store: LeaderboardStore, blobs: BlobStore, grace_s: float):
        self.store, self.blobs, self.grace_s = store, blobs, grace_s

    async def collect(self) -> list[str]:
        """Delete every queued blob that is unreferenced and unheld; returns their digests."""
        deleted = []
        for sha in await self.store.gc_candidates(time.time()):
            if not await self.store.gc_claim(sha):
                continue
            try:
                await run_in_threadpool(self.blobs.delete, sha)
                deleted.append(sha)
            finally:
                await self.store.gc_done(sha)
        if deleted:
            log.info("blobs collected", count=len(deleted))
        return deleted

    async def sweep(self) -> list[str]:
        """Queue stored blobs that nothing references and are older than the grace period."""
        cutoff = time.time() - self.grace_s
        old = await run_in_threadpool(
            lambda: [sha for sha, mtime in self.blobs.list() if mtime < cutoff]
        )
        await self.store.mark_orphans(old)
        # Uploads that crashed half-way leave staging files no blob name refers to.
        await run_in_threadpool(self.blobs.sweep_staging, max(self.grace_s, STAGING_MAX_AGE_S))
        return await self.collect()

    async def run_forever(self, interval_s: float, sweep_every: int = 10) -> None:
        for i in range(1 << 62):
            await asyncio.sleep(interval_s)
            # One failed round (Redis restarting, S3 hiccup) must not stop collection.
            try:
                await (self.sweep() if i % sweep_every == sweep_every - 1 else self.collect())
            except Exception as e:
                log.warning("blob collection failed", error=repr(e))
