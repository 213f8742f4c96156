"""What a pod keeps beyond its life: its TensorBoard event files and its last log lines, in the
leaderboard's blob store (services/leaderboard/artifacts.py), where ``podium tensorboard`` and
``podium logs`` read them.

On Kubernetes a pod has no volume that outlives it, and the orchestrator reads a pod's log when
it asks the pod to stop, before the pod's final report and its last lines. So the pod uploads
its TensorBoard files (as a bundle, services/contracts/bundles.py) after its first report, after
a report when ``interval_s`` has passed since the last upload and they changed, and before it
exits (stopped or failed), with its last log lines then (services/logs.py ``keep_tail``). An
upload that fails is logged, never fatal.
"""

from __future__ import annotations

import io
import math
import time
from pathlib import Path

from services.api_client import LeaderboardClient, LeaderboardError
from services.contracts.artifacts import TENSORBOARD_KIND
from services.contracts.bundles import BundleError, files_under, pack
from services.logs import LogTail, get_logger

log = get_logger(__name__)


#: How long a pod that was not asked to stop (it failed) retries its final uploads.
FINAL_S = 30.0


class PodFiles:
    def __init__(
        self,
        client: LeaderboardClient,
        pod_id: str,
        tensorboard_dir: Path | None,
        tail: LogTail | None,
        interval_s: float = 60.0,
    ) -> None:
        self.client, self.pod_id = client, pod_id
        self.tensorboard_dir, self.tail, self.interval_s = tensorboard_dir, tail, interval_s
        self._uploaded: dict[str, tuple[int, int]] | None = None  # the files last uploaded
        self._last = -math.inf  # the first report uploads: a pod killed later keeps those

    def reported(self) -> None:
        """After a report: the TensorBoard files, at most every ``interval_s``."""
        if time.monotonic() - self._last >= self.interval_s:
            self.tensorboard()

    def tensorboard(self) -> None:
        """Upload the TensorBoard files if they changed since the last upload."""
        self._last = time.monotonic()
        if self.tensorboard_dir is None:
            return
        files = files_under(self.tensorboard_dir)
        if not files or files == self._uploaded:
            return
        out = io.BytesIO()
        try:
            meta = {"kind": TENSORBOARD_KIND, "pod": self.pod_id}
            pack(self.tensorboard_dir, files, meta, out)
            self.client.put_pod_file(self.pod_id, "tensorboard", out.getvalue())
        except (LeaderboardError, OSError, BundleError) as exc:
            log.warning("pod_files.upload_failed", name="tensorboard", error=str(exc))
            return
        self._uploaded = files

    def final(self) -> None:
        """Before the pod exits: its TensorBoard files and its last log lines; retried until
        the client's deadline (a stopped pod's grace period), else for ``FINAL_S``: a pod that
        failed while the leaderboard is down must still exit."""
        if self.client.deadline is None:
            self.client.deadline = time.monotonic() + FINAL_S
        self.tensorboard()
        if self.tail is None:
            return
        try:
            self.client.put_pod_file(self.pod_id, "log", self.tail.text().encode())
        except LeaderboardError as exc:
            log.warning("pod_files.upload_failed", name="log", error=str(exc))
