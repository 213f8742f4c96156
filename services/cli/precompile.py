"""``podium compile SPEC``: put the spec's programs into the compile cache that ``podium run
SPEC`` (the same OUT or data directory) gives its pods, so that they load them in a second or
two instead of training eagerly or compiling (``auto`` weighs the load, not a cold compile).

``compile: auto`` compiles only where a run's own env steps pay for a cold compile (tens of
seconds on a CPU), so a spec whose runs end in a few thousand env steps trains eagerly every
time unless something has filled its cache. This does, on the embedded platform of the run's
data directory: one short experiment per distinct program (each algorithm of the spec, with
each combination of its search space's ``choice`` values, told apart by the program key the
pods share compiles by: a batch size gives another program, a learning rate does not), one pod
with ``compile: on`` training until every program ran."""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Any

from services.cli.client import PodiumClient, resolve
from services.cli.errors import EXIT_API, CliError
from services.cli.live import Watch, stderr_console, wait_for_end
from services.cli.outputs import output_dir
from services.cli.platform import Platform
from services.cli.pod_logs import local_pods_dir
from services.cli.tournament import _shield_signals, _start, check_fits, service_logs
from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.pod_activity import records
from services.contracts.search_space import Choice, IntUniform
from services.contracts.spec import ExperimentSpec

#: More combinations of ``choice`` values than this are refused: each is checked (a pod config
#: built), and a search space that large is not meant to be compiled ahead.
MAX_COMBINATIONS = 256


def programs(spec: ExperimentSpec) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The spec's distinct programs, as (algorithm, the choice values that give it), and a
    line per integer range that changes the program key (each value drawn compiles anew)."""
    from services.pod.runtime.compile_share import program_digest
    from services.pod.training.presets import pod_config

    choices = {n: d.values for n, d in spec.search_space.items() if isinstance(d, Choice)}
    count = len(spec.algorithms) * math.prod(len(values) for values in choices.values())
    if count > MAX_COMBINATIONS:
        raise CliError(
            f"search_space: {count} combinations of algorithms and choice values "
            f"(at most {MAX_COMBINATIONS} are compiled ahead)"
        )
    slots = spec.population.agents_per_pod
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    ranges: list[str] = []
    for algorithm in spec.algorithms:

        def digest(values: dict[str, Any], algorithm: str = algorithm) -> str:
            try:
                configs = [pod_config(spec, values, i, algorithm=algorithm) for i in range(slots)]
            except HyperparameterError as exc:
                raise CliError(f"search_space: {algorithm} with {values}: {exc}") from None
            return program_digest(configs)

        for combination in itertools.product(*choices.values()):
            values = dict(zip(choices, combination, strict=True))
            found.setdefault(digest(values), (algorithm, values))
        for name, dist in spec.search_space.items():
            if isinstance(dist, IntUniform) and digest({name: dist.low}) != digest(
                {name: dist.high}
            ):
                ranges.append(
                    f"{algorithm}: {name} is drawn from {dist.low}..{dist.high} and shapes the "
                    "programs: each value drawn compiles its own (a choice of values would "
                    "compile them here)"
                )
    return list(found.values()), ranges


def warm_up_spec(
    spec: ExperimentSpec, algorithm: str, values: dict[str, Any], index: int
) -> dict[str, Any]:
    """One pod of ``spec`` with ``values`` and ``compile: on`` pinned, trained until each of its
    programs ran (two rounds, and past an off-policy learner's ``learning_starts``)."""
    from services.pod.training.presets import pod_config

    config = pod_config(spec, values, 0, algorithm=algorithm)
    slots = spec.population.agents_per_pod
    rounds = 2 * (spec.round.env_steps or 2048)
    steps = slots * (rounds + getattr(config, "learning_starts", 0))
    data = spec.model_dump(mode="json", exclude_none=True)
    space = data["search_space"]
    for name, value in {**values, "compile": "on"}.items():
        space[name] = {"type": "choice", "values": [value]}
    data.update(
        name=f"{spec.name}-compile-{index}",
        algorithms={algorithm: 1.0},
        budget={"total_env_steps": steps, "wall_time_s": 3600},
        population={**data["population"], "min_pods": 1, "max_pods": 1},
        generator={"strategy": "random"},  # one fresh pod: nothing to select or halve
        round={"env_steps": rounds // 2},
    )
    data.pop("target_return", None)
    data["population"].pop("exploit", None)  # one pod of one slot or a few: nothing to select
    return data


def compiled_programs(data_dir: Path, exp_id: str) -> list[dict[str, Any]]:
    """The ``compile.done`` records of the experiment's pod logs."""
    done: list[dict[str, Any]] = []
    for path in sorted(local_pods_dir(data_dir, exp_id).glob("*.log")):
        done.extend(records(path.read_text(errors="replace"), "compile.done"))
    return done


def compile_spec(spec_file: Path, out: Path | None, data_dir: Path | None, verbose: bool) -> int:
    """Compile the spec's programs into the cache of ``podium run SPEC --out OUT``."""
    from services.contracts.spec import SpecError, load_spec

    try:
        spec = load_spec(spec_file)
    except SpecError as exc:
        raise CliError(str(exc)) from None
    out = out or Path("runs") / spec.name
    data_dir = data_dir or out / "data"
    platform = Platform(data_dir=data_dir, orchestrator_port=0, leaderboard_port=0)
    check_fits(platform, spec)
    import torch

    if spec.resources.gpus > torch.cuda.device_count():
        # Programs compile for the device they run on: its pods would wait for GPUs forever.
        raise CliError(
            f"resources.gpus: the spec's pods need {spec.resources.gpus} GPU(s); this machine "
            f"has {torch.cuda.device_count()} (compile on a machine like the one that will run it)"
        )
    output_dir(out, "--out")
    output_dir(data_dir, "--data-dir")
    console = stderr_console()
    say = console.print
    found, ranges = programs(spec)
    for line in ranges:
        say(f"[yellow]note[/]: {line}")
    service_logs(data_dir, verbose)
    _start(platform)
    failed: list[str] = []
    try:
        urls = (platform.orchestrator_url, platform.token, platform.leaderboard_url)
        client = PodiumClient(resolve(*urls))
        for i, (algorithm, values) in enumerate(found):
            what = ", ".join([algorithm, *(f"{k}={v}" for k, v in sorted(values.items()))])
            start = time.monotonic()
            exp_id = client.submit(warm_up_spec(spec, algorithm, values, i))["id"]
            exp = wait_for_end(Watch(client, exp_id, console, top=1), None, live=False)
            done = compiled_programs(data_dir, exp_id)
            built = sum(int(r.get("graphs_built", 0)) for r in done)
            loaded = sum(int(r.get("graphs_loaded", 0)) for r in done)
            if exp["state"] == "failed" or not done:
                failed.append(f"{what}: {exp.get('reason') or 'no program compiled'}")
                continue
            say(
                f"{what}: {built} graphs compiled, {loaded} already in the cache "
                f"({time.monotonic() - start:.0f} s)"
            )
    finally:
        _shield_signals()
        platform.stop()
    for line in failed:
        say(f"[red]not compiled[/]: {line}")
    if failed:
        raise CliError(f"{len(failed)} of {len(found)} programs not compiled", EXIT_API)
    hint = run_hint(spec_file, spec.name, out, data_dir)
    say(f"compile cache: {data_dir / 'compile-cache'}; `{hint}` loads them")
    return 0


def run_hint(spec_file: Path, name: str, out: Path, data_dir: Path) -> str:
    """The ``podium run`` whose platform has ``data_dir`` (its default: ``OUT/data``)."""
    if data_dir != out / "data":
        return f"podium run {spec_file} --data-dir {data_dir}"
    return f"podium run {spec_file}" + ("" if out == Path("runs") / name else f" --out {out}")
