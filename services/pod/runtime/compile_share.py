"""One compile per experiment and program (docs/deploy.md has the protocol): the first pod that
compiles a program shares its compile cache (compile_cache.py) with the experiment's other pods
through the leaderboard's blob store, keyed by what it depends on (``CompileFacts``: torch build,
device kind, a digest of the pod's code and of its run configs but for the programs' inputs and
what they are not built from: per-agent hyperparameters, seeds, ``NOT_IN_PROGRAMS``). A pod claims
its key before its trainer is built (services/leaderboard/artifacts.py): ``ready``: fetch the
bundle, check every sha256 (nothing unpickled; services/contracts/bundles.py), unpack, load;
``compile``: build (or find indexed in its cache) and publish once the programs ran; ``wait``:
load at once where its cache holds the key's files, else ask again (backoff, jitter) for at most
``wait_s``, then compile here. A failure to share is logged and the pod compiles. Only one
experiment's pods (one credential) publish its caches: saved graphs are pickles."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from services.api_client import LeaderboardClient, LeaderboardError
from services.contracts.artifacts import (
    COMPILE_CACHE_KIND,
    CompileCacheState,
    CompileClaim,
    CompileFacts,
)
from services.contracts.bundles import BundleError, files_under, pack, unpack
from services.logs import get_logger
from services.pod import mkl_dispatch
from services.pod.algorithms.compiled import code_digest, device_kind
from services.pod.config import RunConfig
from services.pod.runtime.compile_cache import TMP
from services.pod.training.trainer import algorithm_card

log = get_logger(__name__)

#: The longest pause between two claims of a pod waiting for another's compile.
MAX_POLL_S = 10.0
#: Downloads of a published cache that failed in transit, tried again before giving up.
FETCH_TRIES = 6
#: Claim renewals per claim TTL, and how long one renewal may take, as a share of the TTL: a
#: pod that dies frees the key, a request that never answers is given up early enough for the
#: next one to renew in time, and a slow leaderboard's answers still count.
RENEWALS_PER_TTL = 6
RENEWAL_TIMEOUT = 0.4
#: Where the cache keeps, per program key, the files of its bundle (fetched, or published by
#: this cache's pod): a pod that claims a key its cache already holds publishes them at once.
INDEX = "podium-share"
#: The cache's directories that hold no program: inductor's locks, temporary files, the index.
SKIP = ("locks", TMP, INDEX, mkl_dispatch.DIRECTORY)


#: A run with another budget (a tensor to PPO) or target, or ``auto`` after ``on``, loads the same.
NOT_IN_PROGRAMS = ("compile", "total_env_steps", "eval_every_steps", "target_return")


def program_digest(configs: Sequence[RunConfig]) -> str:
    """The digest of what fixes a pod's compiled programs: its slot count, its run config but
    for the seeds, ``NOT_IN_PROGRAMS`` and the per-agent hyperparameters (the algorithm card's
    ``population.hyperparameters``: inputs of the programs, not part of them), and its code."""
    first = configs[0]
    card = algorithm_card(first.algorithm)
    per_agent = set(card.population.hyperparameters) if card.population else set()
    config = first.model_dump(mode="json", exclude={"seed", "eval_seed"})
    section = config.get(first.algorithm)
    for name in (*per_agent, *NOT_IN_PROGRAMS):
        config.pop(name, None)
        if isinstance(section, dict):
            section.pop(name, None)
    facts = {"slots": len(configs), "config": config, "code": code_digest()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def compile_facts(configs: Sequence[RunConfig]) -> CompileFacts:
    return CompileFacts(
        torch=torch.__version__,
        device=device_kind(configs[0].device),
        program=program_digest(configs),
    )


class CompileShare:
    """A pod's side of the sharing (the module docstring): ``before_build`` before its trainer
    is built, ``stepped`` after its first training step, ``reported`` after each report."""

    def __init__(
        self,
        client: LeaderboardClient,
        pod_id: str,
        cache_dir: Path,
        wait_s: float = 900.0,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.client, self.pod_id, self.cache_dir = client, pod_id, Path(cache_dir)
        self.wait_s, self.stopping = wait_s, stopping
        self.claim: CompileClaim | None = None
        self.before: dict[str, tuple[int, int]] | None = None  # the cache when we claimed
        self.done: set[str] = set()  # keys settled in this process
        self.indexed: list[str] = []  # the claimed key's files, where this cache holds them
        self.later: bool | None = None  # the trainer's compiles_later at the last step
        self._renew: threading.Event | None = None
        self.outcome: dict[str, object] = {}  # how the last key was settled (logs, tests)

    # -- before the trainer ----------------------------------------------------------------
    def before_build(self, configs: Sequence[RunConfig]) -> None:
        """Fetch the configs' compile cache if another pod published it, or claim the compile
        (waiting while another pod compiles). Never raises: a failure means compiling here."""
        start = time.monotonic()
        try:
            facts = compile_facts(configs)
        except Exception as exc:  # e.g. an algorithm without a card: nothing to share
            log.warning("compile_cache.off", reason=f"{type(exc).__name__}: {exc}")
            return
        key = facts.key()
        if key in self.done:
            return
        self.done.add(key)
        self.outcome = {"key": key, "device": facts.device}
        try:
            self._settle(CompileClaim(pod_id=self.pod_id, facts=facts), start)
        except (LeaderboardError, OSError) as exc:
            self.outcome["state"] = "failed"
            log.warning(
                "compile_cache.unavailable", key=key, error=str(exc), fallback="compile here"
            )

    def _settle(self, claim: CompileClaim, start: float) -> None:
        key = claim.facts.key()
        delay, refused, waited_before, fetch_tries = 0.0, set(), False, 0
        while True:
            state = self.client.compile_claim(claim)
            if state.state == "ready":
                if state.sha256 is None:
                    self._log("nothing_to_fetch", start, holder=state.holder)
                    return
                if state.sha256 in refused:  # refused already, and nobody published anew
                    self._log("refused_twice", start, sha256=state.sha256)
                    return
                try:
                    why = self._fetch(claim, state, start)
                except LeaderboardError as exc:
                    # A download cut off (a leaderboard that sheds connections while hundreds
                    # of pods fetch at once): ask again after a pause, a few times.
                    if exc.status is not None or fetch_tries >= FETCH_TRIES:
                        raise
                    fetch_tries += 1
                    time.sleep(min(2.0**fetch_tries, MAX_POLL_S) * random.uniform(0.5, 1.5))
                    continue
                if why is None:
                    return
                refused.add(state.sha256)
                log.warning("compile_cache.refused", key=key, sha256=state.sha256, reason=why)
                claim = claim.model_copy(update={"refused": state.sha256})
                continue
            claim = claim.model_copy(update={"refused": None})
            if state.state == "compile":
                # This cache holds them already: publish them after the first training step
                # (packing takes a second, not to be added to this pod's start).
                self.indexed = self._indexed(key)
                self._claimed(claim, state, start)
                return
            waited = time.monotonic() - start
            if not waited_before:
                if self._indexed(key):
                    # This cache holds the key's files (a platform's pods share one cache
                    # directory): load them, nothing to wait for.
                    self._log("local", start, holder=state.holder)
                    return
                waited_before = True
                log.info("compile_cache.waiting", key=key, holder=state.holder)
            if waited >= self.wait_s or self.stopping():
                # Compile here; if nobody has published by our first report, we do.
                self.claim, self.before, self.later = claim, files_under(self.cache_dir, SKIP), None
                self._log("wait_expired", start, holder=state.holder)
                return
            # From the leaderboard's hint, backing off to MAX_POLL_S: a thousand waiting pods
            # ask about a hundred times a second, and the last loads at most that late.
            delay = min(max(delay * 1.5, state.retry_after_s or 0.0), MAX_POLL_S)
            time.sleep(min(delay * random.uniform(0.5, 1.5), self.wait_s - waited))

    def _fetch(self, claim: CompileClaim, state: CompileCacheState, start: float) -> str | None:
        """Download, check and unpack the published cache; why it was refused, or None.
        ``start``: when the pod began to settle the key (its wait is logged)."""
        key, begin = claim.facts.key(), time.monotonic()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".fetch-", dir=self.cache_dir)
        os.close(fd)
        tmp = Path(name)
        try:
            sha256, size, header = self.client.compile_fetch(key, tmp)
            if sha256 != state.sha256 or header != state.sha256:
                return f"sha256 {sha256} does not match the record's {state.sha256}"
            expect = {"kind": COMPILE_CACHE_KIND, **claim.facts.model_dump()}
            with open(tmp, "rb") as f:
                manifest = unpack(f, self.cache_dir, expect=expect)
        except BundleError as exc:
            return str(exc)
        except LeaderboardError as exc:
            if exc.status in (404, 410):  # dropped or collected meanwhile: claim again
                return f"gone: {exc}"
            raise
        finally:
            tmp.unlink(missing_ok=True)
        self._write_index(key, manifest["files"])
        self._log(
            "loaded",
            begin,
            holder=state.holder,
            files=len(manifest["files"]),
            bytes=size,
            sha256=sha256,
            waited_s=round(begin - start, 3),
        )
        return None

    def _claimed(self, claim: CompileClaim, state: CompileCacheState, start: float) -> None:
        self.claim, self.before, self.later = claim, files_under(self.cache_dir, SKIP), None
        self._log("claimed", start)
        ttl = state.ttl_s or 60.0
        period = ttl / RENEWALS_PER_TTL
        self._renew = stop = threading.Event()
        # A client of its own: the round loop's is not shared between threads.
        renewer = LeaderboardClient(
            self.client.url,
            self.client.experiment_id,
            retry_for_s=0,
            timeout_s=ttl * RENEWAL_TIMEOUT,
        )
        renewer.http.headers.update(self.client.http.headers)

        def renew() -> None:
            renewed = time.monotonic()
            with renewer:
                while not stop.wait(period):
                    try:
                        renewer.compile_claim(claim)
                        renewed = time.monotonic()
                    except LeaderboardError as exc:
                        log.warning("compile_cache.renew_failed", error=str(exc))
                        if time.monotonic() - renewed > ttl:
                            # The claim has expired at the leaderboard: another pod may compile
                            # the key now, and renewing is over.
                            log.warning("compile_cache.claim_lost", pod=claim.pod_id)
                            return

        threading.Thread(target=renew, name="compile-claim", daemon=True).start()

    # -- after training --------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """This pod compiles a key it has not published yet."""
        return self.claim is not None

    def stepped(self, compile_seconds: float, compiles_later: bool = False) -> None:
        """After each step; acts at the first and when ``compiles_later`` (``auto`` timing, or no
        program run yet) turns false: a trainer that compiled nothing (no seconds, no new files)
        and will not says so at once: no pod waits for a round of an eager one."""
        was, self.later = self.later, compiles_later
        if was is False or (was and compiles_later) or not self.pending:
            return
        if self.indexed or (not compiles_later and compile_seconds <= 0 and not self._new_files()):
            self.publish()

    def _new_files(self) -> list[str]:
        """The cache's files new or resized since the claim (a marker touched again is not)."""
        before = self.before or {}
        now = files_under(self.cache_dir, SKIP)
        return sorted(rel for rel, (size, _) in now.items() if before.get(rel, (-1,))[0] != size)

    def reported(self, compiles_later: bool = False) -> None:
        """At a report: publish, unless the trainer's programs are still to come (then at a
        later report: what the others wait for is the compile, not the round)."""
        if self.pending and not compiles_later:
            self.publish()

    def publish(self) -> None:
        """Publish what appeared in the cache directory since the claim (nothing: say so)."""
        claim, files, indexed = self.claim, self.indexed or self._new_files(), bool(self.indexed)
        self.claim = self.before = None
        self.indexed = []
        self._stop_renewing()
        if claim is not None:
            self._publish(claim, files, time.monotonic(), from_cache=indexed)

    def _publish(
        self, claim: CompileClaim, files: list[str], since: float, from_cache: bool = False
    ) -> None:
        """``files`` of the cache as the key's bundle (none: nothing to share), indexed here."""
        key = claim.facts.key()
        try:
            data, manifest = b"", {"files": {}}
            if files:
                fd, name = tempfile.mkstemp(prefix=".pack-", dir=self.cache_dir)
                try:
                    with os.fdopen(fd, "w+b") as f:
                        meta = {"kind": COMPILE_CACHE_KIND, **claim.facts.model_dump()}
                        meta["pod"] = self.pod_id
                        manifest = pack(self.cache_dir, files, meta, f)
                        f.seek(0)
                        data = f.read()
                finally:
                    os.unlink(name)
            state = self.client.compile_publish(claim, data)
            if files:
                self._write_index(key, manifest["files"])
        except (LeaderboardError, OSError, BundleError) as exc:
            log.warning("compile_cache.publish_failed", key=key, error=str(exc))
            return
        self._log(
            "published",
            since,
            files=len(files),
            bytes=len(data),
            sha256=state.sha256,
            first=state.holder == self.pod_id,
            from_cache=from_cache,
        )

    # -- the index: which files a key's bundle holds ---------------------------------------
    def _index_path(self, key: str) -> Path:
        return self.cache_dir / INDEX / f"{key}.json"

    def _write_index(self, key: str, files: dict[str, dict]) -> None:
        path = self._index_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".index-", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"files": files}, f)
            os.replace(tmp, path)
        except OSError as exc:  # only a later claim's shortcut is lost
            log.warning("compile_cache.index_failed", key=key, error=str(exc))

    def _indexed(self, key: str) -> list[str]:
        """``key``'s bundle's files where this cache holds all, at the index's sizes; else []."""
        try:
            listed = json.loads(self._index_path(key).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        present = files_under(self.cache_dir, SKIP)
        if not isinstance(listed, dict) or not listed:
            return []
        for rel, entry in listed.items():
            if not isinstance(entry, dict) or present.get(rel, (-1,))[0] != entry.get("bytes"):
                return []
        return sorted(listed)

    def _stop_renewing(self) -> None:
        if self._renew is not None:
            self._renew.set()
            self._renew = None

    def close(self) -> None:
        self._stop_renewing()

    def _log(self, state: str, since: float, **fields: object) -> None:
        self.outcome.update(state=state, seconds=round(time.monotonic() - since, 3), **fields)
        log.info(f"compile_cache.{state}", **self.outcome)
