"""What a pod says it is doing: the ``pod activity`` records of its log (written by
services/pod/runtime/activity.py), read back by the live display (services/cli/live.py); and
what ``compile: auto`` decided for it (``DECIDED``), read back by ``podium run``'s last lines.

A record is a JSON log line ``{"event": "pod activity", "activity": A, "seconds": S,
"timestamp": ISO-8601}``: the pod has been doing A for S seconds at that time. Torch-free, so
the command line reads it without importing the pod."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

EVENT = "pod activity"
#: In the order a pod goes through them (evaluating and loading come again with each report).
ACTIVITIES = ("starting", "loading", "compiling", "training", "evaluating")
#: ``compile: auto``'s decision (services/pod/algorithms/compiled.py ``Decision.decide``): a JSON
#: log line with ``compiled``, ``reason`` and ``warm``, what it would have decided with the
#: programs in the compile cache (a load weighed instead of a cold compile).
DECIDED = "compile.decided"
#: How a decision's reason ends where the programs were in the compile cache.
CACHED = "(in the compile cache)"


def last_activity(log_text: str) -> tuple[str, float] | None:
    """The pod's last said activity in ``log_text`` (its log's last lines) and since when
    (epoch seconds); None if the lines hold none."""
    for line in reversed(log_text.splitlines()):
        if EVENT not in line:
            continue
        try:
            record = json.loads(line)
            if record.get("event") != EVENT or record.get("activity") not in ACTIVITIES:
                continue
            at = datetime.fromisoformat(record["timestamp"]).timestamp()
            return record["activity"], at - float(record.get("seconds") or 0.0)
        except (ValueError, KeyError, TypeError):
            continue
    return None


def records(log_text: str, event: str) -> Iterator[dict[str, Any]]:
    """The JSON records of ``event`` in ``log_text`` (a pod's log lines), in order."""
    for line in log_text.splitlines():
        if event not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            yield record


def eager_for_a_cold_compile(log_text: str) -> str | None:
    """Why ``compile: auto`` trained the pod eager where only a cold compile made it (with its
    programs in the compile cache it would have compiled), if ``log_text`` (a pod's log) says
    so; else None."""
    for record in records(log_text, DECIDED):
        if record.get("compiled") is False and record.get("warm"):
            return str(record.get("reason"))
    return None
