"""What the CLI shows of an experiment: the live view while it runs (a panel on a terminal, a
line per change in CI logs), the leaderboard table, the list of experiments, and waiting for
an experiment's end."""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from services.cli.client import TERMINAL, ApiError
from services.contracts.pod_activity import ACTIVITIES, last_activity

if TYPE_CHECKING:
    from rich.console import Console

    from services.cli.client import PodiumClient
    from services.contracts.leaderboard import Leaderboard

STATE_STYLE = {
    "pending": "yellow",
    "running": "cyan",
    "paused": "yellow",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "magenta",
    "budget_exhausted": "yellow",
}


def stderr_console() -> Console:
    """Progress and messages: stderr, so stdout stays for what a script reads."""
    return _console(stderr=True)


def stdout_console() -> Console:
    return _console(stderr=False)


def _console(stderr: bool) -> Console:
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:  # CI logs: wide enough for the leaderboard table
        console.width = max(console.width, 160)
    return console


def fmt(value: float | None, spec: str = ".4g", none: str = "–") -> str:
    return none if value is None else format(value, spec)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


#: How often the live pods' activity is read from their logs, and of at most how many pods.
ACTIVITY_EVERY_S = 2.0
ACTIVITY_PODS = 8


def _live(exp: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in exp.get("pods", []) if p["phase"] in ("Pending", "Running")]


class Watch:
    """Polls an experiment (2 Hz), its leaderboard (0.5 Hz) and what its pods say they are doing
    (``pod activity`` records of their logs, every ``ACTIVITY_EVERY_S``), and renders its
    progress: a live panel on a terminal; in CI logs a line when the state, the number of pods,
    what they do or the best score changes, and every 10 s otherwise (with the seconds a pod
    has been compiling, say: no wait is silent)."""

    def __init__(self, client: PodiumClient, exp_id: str, console: Console, top: int = 5):
        self.client = client
        self.exp_id = exp_id
        self.console = console
        self.top = top
        self.samples: list[dict[str, Any]] = []
        self.rates: deque[tuple[float, int]] = deque()
        self.board: Leaderboard | None = None
        self.board_at = 0.0
        self.first_best: float | None = None
        self.last_line = ("", 0.0)
        #: pod id -> (what it said it does, since when: epoch seconds)
        self.activities: dict[str, tuple[str, float]] = {}
        self.activity_at = 0.0

    def poll(self) -> dict[str, Any]:
        exp = self.client.experiment(self.exp_id)
        now = time.time()
        steps = exp["progress"].get("env_steps")
        best = exp.get("best_score")
        if best is not None and self.first_best is None:
            self.first_best = best
        self.samples.append(
            {"t": now - exp["created_at"], "env_steps": steps, "best": best, "state": exp["state"]}
        )
        if steps is not None:
            self.rates.append((now, steps))
            while len(self.rates) > 2 and now - self.rates[0][0] > 10:
                self.rates.popleft()
        self._read_activities(exp, now)
        due = now - self.board_at > 2.0 or exp["state"] in TERMINAL  # the final board, fresh
        if self.top and due and self.client.endpoints.leaderboard_url:
            self.board_at = now
            # Not registered yet, or the leaderboard is busy: keep the last board.
            with contextlib.suppress(ApiError):
                self.board = self.client.board(self.exp_id, limit=self.top)
        return exp

    def _read_activities(self, exp: dict[str, Any], now: float) -> None:
        live = _live(exp)
        self.activities = {
            k: v for k, v in self.activities.items() if k in {p["pod_id"] for p in live}
        }
        if not live or now - self.activity_at < ACTIVITY_EVERY_S:
            return
        self.activity_at = now
        # The pods least recently started first: with more than ACTIVITY_PODS, those are the
        # ones whose wait is longest.
        for pod in sorted(live, key=lambda p: p["created_at"])[:ACTIVITY_PODS]:
            with contextlib.suppress(ApiError):  # gone meanwhile, or the log is not there yet
                found = last_activity(self.client.pod_logs(self.exp_id, pod["pod_id"], 200))
                if found is not None:
                    self.activities[pod["pod_id"]] = found

    def doing(self, exp: dict[str, Any], seconds: bool = True) -> str:
        """What the live pods do, e.g. ``2 compiling (34 s), 1 training``: per activity, the
        number of pods and (``seconds``) the longest any has been at it; a pod that has said
        nothing yet is ``starting`` (``pending`` before its process runs)."""
        now = time.time()
        groups: dict[str, list[float]] = {}
        for pod in _live(exp):
            default = ("pending" if pod["phase"] == "Pending" else "starting", pod["created_at"])
            activity, since = self.activities.get(pod["pod_id"], default)
            groups.setdefault(activity, []).append(since)
        order = ("pending", *ACTIVITIES)
        parts = []
        for activity in sorted(groups, key=order.index):
            text = f"{len(groups[activity])} {activity}"
            if seconds and activity != "training":
                text += f" ({max(0.0, now - min(groups[activity])):.0f} s)"
            parts.append(text)
        return ", ".join(parts)

    def rate(self) -> float | None:
        if len(self.rates) < 2:
            return None
        (t0, s0), (t1, s1) = self.rates[0], self.rates[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    def render(self, exp: dict[str, Any]) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        prog = exp["progress"]
        state = exp["state"]
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        head = Text.assemble(
            (f"{exp['name']} ", "bold"),
            (f"({exp['id']})  ", "dim"),
            (state, STATE_STYLE.get(state, "")),
            (f"  {exp.get('reason') or ''}", "dim"),
        )
        grid.add_row("experiment", head)

        def bar_row(label: str, frac: float | None, text: str) -> None:
            if frac is None:
                grid.add_row(label, text)
                return
            row = Table.grid(padding=(0, 1))
            row.add_row(ProgressBar(total=1.0, completed=max(0.0, min(1.0, frac)), width=30), text)
            grid.add_row(label, row)

        best, target = exp.get("best_score"), prog.get("target_return")
        frac = None
        if best is not None and target is not None and self.first_best is not None:
            # From 0 for positive rewards (CartPole), from the first score otherwise (Pendulum).
            base = 0.0 if target > 0 and self.first_best >= 0 else self.first_best
            span = target - base
            frac = 1.0 if span == 0 else (best - base) / span
        bar_row("best score", frac, f"{fmt(best)} / target {fmt(target)}")
        steps, total = prog.get("env_steps"), prog.get("total_env_steps")
        rate = self.rate()
        steps_text = f"{steps or 0:,}" + (f" / {total:,}" if total else "")
        if rate is not None:
            steps_text += f"   {rate:,.0f} env steps/s"
        bar_row("env steps", (steps or 0) / total if total else None, steps_text)
        live = _live(exp)
        launched = f"{prog.get('pods_launched', 0)}" + (
            f"/{prog['pods_budget']}" if prog.get("pods_budget") else ""
        )
        kinds = Counter(p["algorithm"] for p in live if p.get("algorithm"))
        trains = ", ".join(f"{n} {a}" for a, n in sorted(kinds.items()))
        grid.add_row(
            "pods",
            f"{len(live)} running{f' ({trains})' if trains else ''}, "
            f"{exp.get('desired_pods', 0)} wanted, {launched} launched",
        )
        if doing := self.doing(exp):
            grid.add_row("pods doing", doing)
        wall = prog.get("wall_time_s")
        grid.add_row(
            "elapsed",
            duration(prog.get("elapsed_s")) + (f" / {duration(wall)}" if wall else ""),
        )
        parts: list[Any] = [grid]
        if self.board and self.board.candidates:
            parts.append(
                board_table(self.board, self.top, title="leaderboard", width=self.console.width)
            )
        return Group(*parts)

    def line(self, exp: dict[str, Any]) -> str | None:
        prog = exp["progress"]
        live = len(_live(exp))
        rate = self.rate()
        key = f"{exp['state']}|{live}|{exp.get('best_score')}|{self.doing(exp, seconds=False)}"
        doing = self.doing(exp)
        text = (
            f"[{duration(prog.get('elapsed_s'))}] {exp['state']:<9} pods {live} "
            f"best {fmt(exp.get('best_score'))}/{fmt(prog.get('target_return'))} "
            f"env steps {prog.get('env_steps') or 0:,}"
            + (f" ({rate:,.0f}/s)" if rate is not None else "")
            + (f" | {doing}" if doing else "")
        )
        now = time.monotonic()
        if key != self.last_line[0] or now - self.last_line[1] >= 10:
            self.last_line = (key, now)
            return text
        return None


#: Below this many columns the leaderboard table leaves out ± std, pod and trained: every
#: column at its width would not fit 80, and rich would shrink the rank and hyperparameter
#: columns to nothing.
WIDE_TABLE = 120


def board_table(
    board: Leaderboard, top: int, title: str | None = None, width: int | None = None
) -> Any:
    """The best ``top`` candidates; ``width``: the console's (narrower than ``WIDE_TABLE``:
    the columns a reader can do without are left out; the hyperparameters wrap, one per line
    where need be)."""
    from rich.table import Table

    wide = width is None or width >= WIDE_TABLE
    table = Table(title=title, title_justify="left", header_style="bold")
    columns = [
        ("#", {"justify": "right", "no_wrap": True, "min_width": len(str(top))}),
        ("candidate", {"no_wrap": True, "min_width": 22}),
        ("score", {"justify": "right", "no_wrap": True, "min_width": 7}),
        ("± std", {"justify": "right", "no_wrap": True, "min_width": 5}),
        ("algorithm", {"no_wrap": True, "min_width": 9}),
        ("gen", {"justify": "right", "no_wrap": True, "min_width": 3}),
        ("pod", {"no_wrap": True, "min_width": 8}),
        ("trained", {"justify": "right", "no_wrap": True, "min_width": 9}),
        ("hyperparameters", {"overflow": "fold", "ratio": 1, "min_width": 16}),
    ]
    narrow = {"± std", "pod", "trained"}
    for col, kw in columns:
        if wide or col not in narrow:
            table.add_column(col, **kw)
    for c in board.candidates[:top]:
        hp = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in sorted(c.hyperparameters.items())
        )
        cells = {
            "#": str(c.rank or ""),
            "candidate": c.candidate_id,
            "score": f"{c.score:.4g}",
            "± std": f"{c.eval.get('std', 0.0):.3g}",
            "algorithm": c.algorithm,
            "gen": str(c.generation),
            "pod": c.pod_id,
            "trained": "" if c.trained_env_steps is None else f"{c.trained_env_steps:,}",
            "hyperparameters": hp,
        }
        table.add_row(*(cells[col] for col, _ in columns if wide or col not in narrow))
    return table


def experiments_table(exps: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(header_style="bold")
    for col in ("id", "name", "state", "best", "target", "pods", "env steps", "elapsed"):
        table.add_column(col)
    for e in exps:
        p = e["progress"]
        table.add_row(
            e["id"],
            e["name"],
            f"[{STATE_STYLE.get(e['state'], '')}]{e['state']}[/]",
            fmt(e.get("best_score")),
            fmt(p.get("target_return")),
            str(sum(x["phase"] in ("Pending", "Running") for x in e["pods"])),
            f"{p.get('env_steps') or 0:,}",
            duration(p.get("elapsed_s")),
        )
    return table


def print_status(
    console: Console, watch: Watch, exp: dict[str, Any], events: list[dict[str, Any]]
) -> None:
    """One experiment: its panel, its last failure and its recent events."""
    console.print(watch.render(exp))
    if exp.get("last_failure"):
        lf = exp["last_failure"]
        console.print(f"[red]last failure[/] pod {lf.get('pod_id')}: {lf.get('reason')}")
        if lf.get("log_tail"):
            console.print(lf["log_tail"], markup=False)
    for ev in events:
        stamp = time.strftime("%H:%M:%S", time.localtime(ev["ts"]))
        pod = f" [{ev['pod_id']}]" if ev.get("pod_id") else ""
        console.print(f"{stamp} {ev['type']}{pod}: {ev['message']}", markup=False)


def print_board(console: Console, board: Leaderboard, experiment: str) -> None:
    if not board.candidates:
        console.print(f"the leaderboard of {experiment} is empty")
        return
    stats = board.stats
    title = f"leaderboard of {experiment}"
    console.print(board_table(board, len(board.candidates), title, width=console.width))
    console.print(
        f"{stats.size}/{stats.top_k} candidates, score mean {fmt(stats.score_mean)} "
        f"± {fmt(stats.score_std)}, algorithms {stats.algorithms}"
    )


class WaitTimeoutError(Exception):
    """--timeout passed while waiting; the message is the experiment's state."""


def wait_for_end(
    watch: Watch,
    timeout: float | None,
    live: bool,
    interval: float = 0.5,
) -> dict[str, Any]:
    """Poll until the experiment has ended and its result is final (the last pod's final report
    counted); raises WaitTimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout if timeout else None

    def ended(exp: dict[str, Any]) -> bool:
        return exp["state"] in TERMINAL and exp.get("result") is not None

    if live:
        from rich.live import Live

        exp = watch.poll()
        with Live(
            watch.render(exp), console=watch.console, refresh_per_second=4, transient=False
        ) as view:
            while not ended(exp):
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeoutError(exp["state"])
                time.sleep(interval)
                exp = watch.poll()
                view.update(watch.render(exp))
        return exp
    while True:
        exp = watch.poll()
        line = watch.line(exp)
        if line:
            watch.console.print(line)
        if ended(exp):
            return exp
        if deadline is not None and time.monotonic() > deadline:
            raise WaitTimeoutError(exp["state"])
        time.sleep(interval)


def cancel_quietly(client: PodiumClient, exp_id: str) -> None:
    """Cancel, unless it has just ended by itself (409: nothing to cancel)."""
    try:
        client.cancel(exp_id)
    except ApiError as exc:
        if exc.status != 409:
            raise
