"""A stand-in training pod: a real process that behaves like a pod toward the orchestrator.

Configured through the experiment spec it receives (``PODIUM_SPEC``), under env.kwargs.standin:

- ``report_interval_s``: how often it reports to the leaderboard (``PODIUM_LEADERBOARD_URL``);
- ``score_step``: each report's score is ``score_step * report_number``;
- ``score_by_pod``: each report's score is instead this pod's own, the same in each of its
  reports: a number in [0, score_by_pod) drawn from its pod id (a tournament's better and
  worse pods);
- ``env_steps_per_report``: env steps each report carries;
- ``crash_after_s``: exit with code ``crash_code`` (default 3) after this long (a crashing
  pod); code 2 is a pod refusing its input, with the real pod's JSON "bad input" line; with
  ``crash_signal`` (e.g. "SIGSEGV") it kills itself with that signal instead, without a line;
- ``crash_after_reports``: crash in the same way right after this many reports (a crash whose
  log lines do not depend on how fast a loaded machine runs the pod);
- ``info_lines``: print a JSON info line (as the real pod logs) after each report;
- ``activity``: say this activity at the start, in the real pod's ``pod activity`` record
  (services/contracts/pod_activity.py), as if it had been at it for ``activity_s`` seconds;
- ``ignore_max_env_steps``: do not cut at ``PODIUM_MAX_ENV_STEPS`` (a pod whose last report
  arrives after the experiment ended).
- ``compile_decided``: log these fields at the start as the real pod's ``compile: auto``
  decision record (``compile.decided``, services/contracts/pod_activity.py).

With ``PODIUM_MAX_ENV_STEPS`` set, a report carries at most the steps left of that allowance,
and the pod exits 0 once it is spent (the real pod cuts its round there and makes its final
report). With ``batch_env_steps`` set it trains whole batches only, as a real pod does: a
report carries whole batches, and the pod exits 0 once less than a batch is left (a pod whose
allowance is below one batch reports 0 steps and exits).

On SIGTERM it makes a final report, writes ``<pod>.final`` into ``PODIUM_POD_DIR`` (when set)
and exits 0, as a real pod does when scaled in or stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

exp_id = os.environ["PODIUM_EXPERIMENT_ID"]
pod_id = os.environ["PODIUM_POD_ID"]
spec = json.loads(os.environ["PODIUM_SPEC"])
cfg = spec["env"]["kwargs"].get("standin", {})
url = os.environ.get("PODIUM_LEADERBOARD_URL")
token = os.environ.get("PODIUM_API_TOKEN")
pod_dir = os.environ.get("PODIUM_POD_DIR")
reports = 0
allowance = os.environ.get("PODIUM_MAX_ENV_STEPS")
max_steps = None if allowance is None or cfg.get("ignore_max_env_steps") else int(allowance)
taken = 0
batch = cfg.get("batch_env_steps") or 1


def report() -> None:
    global reports, taken
    if not url:
        return
    reports += 1
    score = cfg.get("score_step", 0.0) * reports
    if cfg.get("score_by_pod"):
        draw = int(hashlib.sha256(pod_id.encode()).hexdigest()[:8], 16) / 16**8
        score = cfg["score_by_pod"] * draw
    steps = cfg.get("env_steps_per_report", 0)
    if max_steps is not None:
        steps = max(0, min(steps, (max_steps - taken) // batch * batch))
    taken += steps
    body = {  # a metadata-only SubmissionResult, as the leaderboard's updater takes it
        "submission_id": f"{pod_id}-{reports}",
        "pod_id": pod_id,
        "algorithm": os.environ.get("PODIUM_ALGORITHM") or next(iter(spec["algorithms"])),
        "score": score,
        "eval": {"mean": score, "episodes": 1},
        "env_steps": steps,
    }
    req = urllib.request.Request(
        f"{url}/api/v1/experiments/{exp_id}/submissions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        method="POST",
    )
    lines = []
    try:
        urllib.request.urlopen(req, timeout=5).read()
    except OSError as e:
        lines.append(f"report failed: {e}")
    if cfg.get("info_lines"):
        line = {"event": "round reported", "level": "info", "pod": pod_id, "score": score}
        lines.append(json.dumps(line))
    # One write per report, so that a pod killed at any moment has its info line last
    # (printed one by one, a kill could fall between a failure and its info line).
    sys.stdout.write("".join(f"{x}\n" for x in lines))
    sys.stdout.flush()


def on_term(signum, frame):
    report()
    if pod_dir:
        Path(pod_dir, f"{pod_id}.final").write_text("reported\n")
    print("SIGTERM: final report made, exiting", flush=True)
    sys.exit(0)


# A connection's first host lookup imports the idna codec; a SIGTERM landing during that import
# made the handler's report import it again, half done: "LookupError: unknown encoding: idna",
# and no final report. Imported before the handler can run.
"localhost".encode("idna")
signal.signal(signal.SIGTERM, on_term)
gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
print(
    f"pod {pod_id} of {exp_id} started argv={sys.argv[1:]} gpus={gpus!r} max_env_steps={allowance}",
    flush=True,
)
if cfg.get("activity"):
    said = {
        "event": "pod activity",
        "level": "info",
        "activity": cfg["activity"],
        "seconds": cfg.get("activity_s", 0.0),
        "timestamp": datetime.now(UTC).isoformat(),
    }
    print(json.dumps(said), flush=True)
if cfg.get("compile_decided"):
    print(json.dumps({"event": "compile.decided", "level": "info", **cfg["compile_decided"]}))


def crash() -> None:
    if cfg.get("crash_signal"):
        os.kill(os.getpid(), getattr(signal, cfg["crash_signal"]))
    code = cfg.get("crash_code", 3)
    if code == 2:
        bad = "cannot train dqn on Pendulum-v1: dqn needs a Discrete action space"
        print(json.dumps({"event": "bad input", "level": "error", "error": bad}), flush=True)
    else:
        print("simulated crash: CUDA error: out of memory", flush=True)
    sys.exit(code)


start = time.monotonic()
interval = cfg.get("report_interval_s", 0.0)
next_report = start + interval if interval else float("inf")
crash_after = cfg.get("crash_after_s")
while True:
    now = time.monotonic()
    if crash_after is not None and now - start >= crash_after:
        crash()
    if now >= next_report:
        report()
        next_report = now + interval
        if reports == cfg.get("crash_after_reports"):
            crash()
        if max_steps is not None and max_steps - taken < batch:
            print("env-step allowance spent: final report made, exiting", flush=True)
            sys.exit(0)
    time.sleep(0.02)
