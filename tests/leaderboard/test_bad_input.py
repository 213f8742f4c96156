"""Every bad input gets a clear 4xx/503 naming the problem, and nothing is stored."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services import redis_client
from services.leaderboard.app import create_app
from tests.leaderboard.conftest import AUTH, experiment, multipart, result, settings_for

API = "/api/v1/experiments"


def blob_files(data_dir: Path) -> list[Path]:
    return [p for p in (data_dir / "blobs").glob("??/??/*")]


def staging_files(data_dir: Path) -> list[Path]:
    return list((data_dir / "blobs" / ".staging").glob("*"))


def board(client: TestClient, exp: str = "e") -> list[float]:
    return [c["score"] for c in client.get(f"{API}/{exp}/leaderboard").json()["candidates"]]


def locs(r) -> list[list]:
    return [e["loc"] for e in r.json()["detail"]]


def test_schema_violations_name_the_field(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment())
    bad = result("s1", 1.0)
    del bad["eval"]
    r = client.post(f"{API}/e/submissions", json=bad)
    assert r.status_code == 422 and ["body", "result", "eval"] in locs(r)
    r = client.post(f"{API}/e/submissions", json={**result("s1", 1.0), "surprise": 1})
    assert r.status_code == 422 and ["body", "result", "surprise"] in locs(r)
    r = client.post(f"{API}/e/submissions", json={**result("s1", 1.0), "generation": -1})
    assert r.status_code == 422 and ["body", "result", "generation"] in locs(r)
    r = client.post(f"{API}/e/submissions", json={**result("s1", 1.0), "files": {"a": "xyz"}})
    assert r.status_code == 422 and ["body", "result", "files"] in locs(r)
    r = client.post(f"{API}/e/submissions", json=result("s1", 1.0, algorithm="dqn"))
    assert r.status_code == 422 and locs(r) == [["body", "result", "algorithm"]]

    r = client.put(f"{API}/x", json={**experiment(), "top_k": 0})
    assert r.status_code == 422 and ["body", "top_k"] in locs(r)
    r = client.put(f"{API}/x", json=experiment(strategy="no-such-strategy"))
    assert r.status_code == 422 and locs(r) == [["body", "generator", "strategy"]]
    assert "pbt" in r.json()["detail"][0]["msg"]  # lists the known names
    r = client.put(f"{API}/x", json=experiment(options={"quantile": 2}))
    assert r.status_code == 422 and locs(r) == [["body", "generator", "options", "quantile"]]
    space = {"lr": {"type": "log_uniform", "low": 0, "high": 1}}
    r = client.put(f"{API}/x", json=experiment(search_space=space))
    assert r.status_code == 422 and locs(r)[0][:3] == ["body", "search_space", "lr"]
    r = client.put(f"{API}/x", json=experiment(algorithms={}))
    assert r.status_code == 422 and ["body", "algorithms"] in locs(r)
    r = client.post(f"{API}/e/generate", json={"pod": "p"})
    assert r.status_code == 422
    assert {tuple(x) for x in locs(r)} == {("body", "pod_id"), ("body", "pod")}
    assert client.get(f"{API}/x").status_code == 404  # nothing was created
    assert board(client) == []


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_scores_rejected(client: TestClient, value: str) -> None:
    client.put(f"{API}/e", json=experiment())
    body = json.dumps(result("s1", 0.0)).replace('"score": 0.0', f'"score": {value}')
    r = client.post(
        f"{API}/e/submissions", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422 and ["body", "result", "score"] in locs(r)
    assert board(client) == []
    # The id was not consumed: a corrected retry is accepted.
    assert client.post(f"{API}/e/submissions", json=result("s1", 1.0)).json()["accepted"]


def test_unknown_experiment_is_404(client: TestClient) -> None:
    for method, path, kw in [
        ("get", "/nope", {}),
        ("delete", "/nope", {}),
        ("get", "/nope/leaderboard", {}),
        ("get", "/nope/best", {}),
        ("get", "/nope/lineage", {}),
        ("get", "/nope/candidates/c-1", {}),
        ("post", "/nope/generate", {"json": {"pod_id": "p"}}),
        ("post", "/nope/submissions", {"json": result("s1", 1.0)}),
        (
            "post",
            "/nope/submissions",
            {"files": multipart(result("s1", 1.0, {"a": b"x"}), {"a": b"x"})},
        ),
    ]:
        r = getattr(client, method)(f"{API}{path}", **kw)
        assert r.status_code == 404, (method, path, r.text)
        assert "nope" in r.json()["detail"]
    client.put(f"{API}/e", json=experiment())
    assert client.get(f"{API}/e/candidates/c-1").status_code == 404
    assert client.get(f"{API}/e/best").status_code == 404  # empty board


def test_upload_over_limit_is_413_and_nothing_stored(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "d", max_upload_bytes=64 * 1024)
    with TestClient(create_app(settings), headers=AUTH) as client:
        client.put(f"{API}/e", json=experiment())
        big = {"replay_buffer": b"r" * (100 * 1024)}
        r = client.post(f"{API}/e/submissions", files=multipart(result("s1", 1.0, big), big))
        assert r.status_code == 413 and "limit" in r.json()["detail"]

        # Without Content-Length (chunked), the limit is enforced while streaming.
        def chunks():
            yield json.dumps(result("s2", 1.0)).encode()
            for _ in range(100):
                yield b" " * 1024

        r = client.post(
            f"{API}/e/submissions", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 413
        assert board(client) == []
        assert blob_files(settings.data_dir) == [] and staging_files(settings.data_dir) == []
        ok = {"actor": b"a" * 1024}
        r = client.post(f"{API}/e/submissions", files=multipart(result("s3", 1.0, ok), ok))
        assert r.status_code == 200 and r.json()["accepted"]


def test_metadata_only_json_is_bounded_like_a_field_not_like_an_upload(client: TestClient) -> None:
    """A JSON result is held in memory: it gets the 1 MiB field limit, not the upload limit."""
    client.put(f"{API}/e", json=experiment())
    body = json.dumps({**result("s1", 1.0), "hyperparameters": {"x": "y" * (2 << 20)}})
    r = client.post(
        f"{API}/e/submissions", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413
    assert board(client) == []


def test_hash_mismatch_is_400_and_nothing_stored(client: TestClient, lb_settings) -> None:
    client.put(f"{API}/e", json=experiment())
    declared = {"actor": b"what I said", "critic": b"critic"}
    sent = {"actor": b"what I sent", "critic": b"critic"}
    r = client.post(f"{API}/e/submissions", files=multipart(result("s1", 1.0, declared), sent))
    assert r.status_code == 400
    assert "actor" in r.json()["detail"] and "sha256" in r.json()["detail"]
    assert board(client) == []
    assert blob_files(lb_settings.data_dir) == []  # not even the matching critic
    assert staging_files(lb_settings.data_dir) == []
    # The id was not consumed.
    r = client.post(f"{API}/e/submissions", files=multipart(result("s1", 1.0, sent), sent))
    assert r.json()["accepted"] is True


def test_file_parts_must_match_declared_files(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment())
    files = {"actor": b"a"}
    r = client.post(f"{API}/e/submissions", files=multipart(result("s1", 1.0, files), {}))
    assert r.status_code == 422 and ["body", "files", "actor"] in locs(r)
    r = client.post(
        f"{API}/e/submissions",
        files=multipart(result("s1", 1.0, files), {**files, "extra": b"x"}),
    )
    assert r.status_code == 422 and ["body", "extra"] in locs(r)
    r = client.post(f"{API}/e/submissions", files={"actor": ("a", b"a")})
    assert r.status_code == 422 and ["body", "result"] in locs(r)
    r = client.post(f"{API}/e/submissions", json=result("s1", 1.0, files))
    assert r.status_code == 422 and ["body", "files"] in locs(r)
    assert board(client) == []


def test_malformed_multipart_is_422_and_nothing_stored(client: TestClient, lb_settings) -> None:
    client.put(f"{API}/e", json=experiment())
    files = {"actor": b"a" * 1000}
    res = json.dumps(result("s1", 1.0, files))
    twice = [
        ("result", (None, res, "application/json")),
        ("actor", ("a", b"a" * 1000)),
        ("actor", ("a", b"a" * 1000)),
    ]
    r = client.post(f"{API}/e/submissions", files=twice)
    assert r.status_code == 422 and ["body", "actor"] in locs(r) and "twice" in r.text
    r = client.post(
        f"{API}/e/submissions",
        content=b"--xyz\r\nnot a part",
        headers={"Content-Type": "multipart/form-data; boundary=xyz"},
    )
    assert r.status_code == 422
    r = client.post(
        f"{API}/e/submissions", content=b"", headers={"Content-Type": "multipart/form-data"}
    )
    assert r.status_code == 422 and "boundary" in r.text
    assert board(client) == []
    assert blob_files(lb_settings.data_dir) == [] and staging_files(lb_settings.data_dir) == []


def test_redis_down_is_503_without_partial_writes(lb_settings) -> None:
    with TestClient(create_app(lb_settings), headers=AUTH) as client:
        client.put(f"{API}/e", json=experiment(top_k=3))
        files = {"actor": b"kept"}
        client.post(f"{API}/e/submissions", files=multipart(result("s0", 1.0, files), files))
        assert redis_client.stop(lb_settings, force=True)

        new_files = {"actor": b"never stored"}
        r = client.post(
            f"{API}/e/submissions", files=multipart(result("s1", 5.0, new_files), new_files)
        )
        assert r.status_code == 503 and "Redis" in r.json()["detail"]
        assert client.post(f"{API}/e/submissions", json=result("s2", 6.0)).status_code == 503
        assert client.get(f"{API}/e/leaderboard").status_code == 503
        assert client.post(f"{API}/e/generate", json={"pod_id": "p"}).status_code == 503
        assert client.get("/readyz").status_code == 503
        assert client.get("/livez").status_code == 200
    shas = {p.name for p in blob_files(lb_settings.data_dir)}
    assert shas == {hashlib.sha256(b"kept").hexdigest()}
    # Redis back (a fresh app on the same data): exactly the state before the outage.
    with TestClient(create_app(lb_settings), headers=AUTH) as client:
        assert board(client) == [1.0]
        r = client.post(f"{API}/e/submissions", json=result("s2", 6.0))
        assert r.json()["accepted"] and r.json()["duplicate"] is False


def test_stream_cursor_beyond_64_bits_is_refused_and_the_last_id_ends_the_log(
    client: TestClient,
) -> None:
    """A cursor part above 2^64-1 answered 500 (Redis refused the id)."""
    client.put(f"{API}/e", json=experiment())
    assert client.post(f"{API}/e/submissions", json=result("s1", 1.0)).status_code == 200
    big = str(2**64)
    for after in (f"{big}-0", f"0-{big}", f"{big}-{big}"):
        r = client.get(f"{API}/e/submissions", params={"after": after})
        assert r.status_code == 422 and locs(r) == [["query", "after"]], (after, r.text)
    top = str(2**64 - 1)
    r = client.get(f"{API}/e/submissions", params={"after": f"{top}-{top}"})
    assert r.status_code == 200 and r.json()["submissions"] == [], r.text
    r = client.get(f"{API}/e/submissions", params={"after": "0-0"})
    assert [s["submission_id"] for s in r.json()["submissions"]] == ["s1"]


def raw_put(client: TestClient, exp: str, body: dict, **literals: str):
    """PUT with JSON literals Python's json module writes but strict JSON lacks (NaN, Infinity,
    1e309): each ``"@name@"`` string in ``body`` is replaced by ``literals[name]``."""
    text = json.dumps(body)
    for name, literal in literals.items():
        text = text.replace(f'"@{name}@"', literal)
    return client.put(f"{API}/{exp}", content=text, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    ("strategy", "options", "literal", "field"),
    [
        ("cem", {"min_std_fraction": "@x@"}, "Infinity", "min_std_fraction"),
        ("cem", {"categorical_smoothing": "@x@"}, "1e309", "categorical_smoothing"),
        ("pbt", {"perturb_factors": ["@x@"]}, "Infinity", "perturb_factors[0]"),
        ("pbt", {"perturb_factors": ["@x@"]}, "NaN", "perturb_factors[0]"),
        ("pbt", {"nested": {"deep": [1, {"x": "@x@"}]}}, "-Infinity", "nested.deep[1].x"),
    ],
)
def test_non_finite_generator_options_are_refused_naming_the_field(
    client: TestClient, strategy: str, options: dict, literal: str, field: str
) -> None:
    """These were stored as null and every generate then answered 500."""
    r = raw_put(client, "x", experiment(strategy=strategy, options=options), x=literal)
    assert r.status_code == 422, r.text
    assert locs(r) == [["body", "generator", "options"]]
    assert field in r.json()["detail"][0]["msg"]
    assert client.get(f"{API}/x").status_code == 404  # nothing stored
    assert client.post(f"{API}/x/generate", json={"pod_id": "p"}).status_code == 404


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"min_std_fraction": 1e308}, ["min_std_fraction"]),
        ({"categorical_smoothing": 1e308}, ["categorical_smoothing"]),
        ({"perturb_factors": [1e308]}, ["perturb_factors", 0]),
        ({"perturb_factors": [-1.0]}, ["perturb_factors", 0]),
    ],
)
def test_options_that_overflow_a_float_are_refused(
    client: TestClient, options: dict, field: list
) -> None:
    """Finite but huge: CEM's covariance or PBT's step overflowed into a 500 at generate."""
    strategy = "pbt" if "perturb_factors" in options else "cem"
    r = client.put(f"{API}/x", json=experiment(strategy=strategy, options=options))
    assert r.status_code == 422 and ["body", "generator", "options", *field] in locs(r), r.text


def test_non_finite_numbers_anywhere_in_an_experiment_or_a_report_are_refused(
    client: TestClient,
) -> None:
    r = raw_put(client, "x", experiment(algorithms={"ppo": "@w@"}), w="1e309")
    assert r.status_code == 422 and locs(r)[0][:2] == ["body", "algorithms"], r.text
    assert client.get(f"{API}/x").status_code == 404
    client.put(f"{API}/e", json=experiment())
    for path, hyper, literal in (
        ("lr", {"lr": "@v@", "gamma": 0.99}, "NaN"),
        ("net.sizes[1]", {"lr": 0.1, "net": {"sizes": [64, "@v@"]}}, "Infinity"),
    ):
        text = json.dumps(result("s1", 1.0, hyperparameters=hyper)).replace('"@v@"', literal)
        r = client.post(
            f"{API}/e/submissions", content=text, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 422 and locs(r) == [["body", "result", "hyperparameters"]]
        assert path in r.json()["detail"][0]["msg"], r.text
    assert board(client) == []
    r = client.post(
        f"{API}/e/generate",
        content='{"pod_id": "p", "score": 1e309}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422 and locs(r) == [["body", "score"]]


def test_a_board_with_hand_made_hyperparameters_outside_the_space_still_generates(
    client: TestClient,
) -> None:
    """A report whose values lie far outside the search space must not break CEM's fit."""
    client.put(f"{API}/e", json=experiment(strategy="cem", options={"min_elite": 2}))
    wild = {"lr": 1e308, "gamma": -1e308, "batch_size": 1e308, "epochs": 10**30}
    for i, hyper in enumerate([wild, result("x", 0)["hyperparameters"], wild]):
        client.post(f"{API}/e/submissions", json=result(f"s{i}", float(i), hyperparameters=hyper))
    for i in range(5):
        r = client.post(f"{API}/e/generate", json={"pod_id": f"p{i}"})
        assert r.status_code == 200, r.text
        h = r.json()["hyperparameters"]
        assert 1e-5 <= h["lr"] <= 1e-2 and 1 <= h["epochs"] <= 10


def test_unregistered_algorithm_names_are_refused(client: TestClient) -> None:
    """Any algorithm name was accepted; pods then failed to build it."""
    r = client.put(f"{API}/x", json=experiment(algorithms={"ppo": 1.0, "a3c": 1.0}))
    assert r.status_code == 422 and locs(r) == [["body", "algorithms", "a3c"]], r.text
    assert "ppo" in r.json()["detail"][0]["msg"]  # lists the known names
    assert client.get(f"{API}/x").status_code == 404
    assert client.put(f"{API}/x", json=experiment(algorithms={"sac": 1.0})).status_code == 201


def test_a_stored_config_that_no_longer_validates_is_a_409_for_that_experiment_only(
    client: TestClient, lb_settings
) -> None:
    """Defence in depth: a record written before the checks (options stored as null, a
    strategy plugin since uninstalled) answers 409 naming the problem, never a 500, leaves the
    other experiments alone, and a PUT of a corrected configuration (or a DELETE) mends it."""
    from services.leaderboard.store import Keys

    client.put(f"{API}/bad", json=experiment(strategy="cem"))
    for exp in ("plugin", "space", "good"):
        client.put(f"{API}/{exp}", json=experiment())
    for exp in ("bad", "good"):
        client.post(f"{API}/{exp}/submissions", json=result("s1", 1.0))
    r = redis_client.connect(lb_settings)
    try:
        for exp, generator in (
            ("bad", {"strategy": "cem", "options": {"min_std_fraction": None}}),
            ("plugin", {"strategy": "uninstalled-plugin", "options": {}}),
        ):
            stored = json.loads(r.hget(Keys(exp).config, "json"))
            r.hset(Keys(exp).config, "json", json.dumps({**stored, "generator": generator}))
        stored = json.loads(r.hget(Keys("space").config, "json"))
        space = {"lr": {"type": "uniform", "low": None, "high": 1.0}}
        r.hset(Keys("space").config, "json", json.dumps({**stored, "search_space": space}))
    finally:
        r.close()

    for exp, problem in (("bad", "min_std_fraction"), ("plugin", "uninstalled-plugin")):
        g = client.post(f"{API}/{exp}/generate", json={"pod_id": "p"})
        assert g.status_code == 409 and problem in g.json()["detail"], g.text
    # Its stored config stays readable: that is how one sees what is wrong.
    got = client.get(f"{API}/bad").json()
    assert got["generator"]["options"] == {"min_std_fraction": None}
    assert client.get(f"{API}/bad/leaderboard").status_code == 200
    # A config the experiment model itself refuses: reads answer 409 too.
    for path in ("space", "space/leaderboard", "space/generate"):
        got = client.request(
            "POST" if "generate" in path else "GET",
            f"{API}/{path}",
            json={"pod_id": "p"} if "generate" in path else None,
        )
        assert got.status_code == 409 and "search_space.lr" in got.json()["detail"], got.text
    # Reports are still taken (nothing is lost while the config is being mended).
    assert client.post(f"{API}/bad/submissions", json=result("s2", 2.0)).json()["accepted"]
    assert client.post(f"{API}/good/generate", json={"pod_id": "p"}).status_code == 200
    assert client.get(f"{API}").json() == ["bad", "good", "plugin", "space"]

    assert client.put(f"{API}/bad", json=experiment(strategy="cem")).status_code == 200
    assert client.post(f"{API}/bad/generate", json={"pod_id": "p"}).status_code == 200
    assert [c["score"] for c in client.get(f"{API}/bad/leaderboard").json()["candidates"]] == [
        2.0,
        1.0,
    ]
    assert client.delete(f"{API}/plugin").status_code == 204


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        (experiment(higher_is_better=0), ["body", "higher_is_better"]),
        (
            experiment(search_space={"n": {"type": "int_uniform", "low": 1, "high": False}}),
            ["body", "search_space", "n", "int_uniform", "high"],
        ),
        (experiment(options={"explore": 1}), ["body", "generator", "options"]),
    ],
)
def test_inputs_are_not_coerced_between_bool_and_number(
    client: TestClient, body: dict, loc: list
) -> None:
    """Schemathesis found `0` taken as false and `false` as 0.0: a client's slip silently
    became another experiment. Input models are strict now."""
    r = client.put("/api/v1/experiments/strict", json=body, headers=AUTH)
    assert r.status_code == 422, r.text
    assert any(got[: len(loc)] == loc for got in locs(r)), locs(r)
    client.put("/api/v1/experiments/strict", json=experiment(), headers=AUTH)
    r = client.post(
        "/api/v1/experiments/strict/generate", json={"pod_id": "p", "score": False}, headers=AUTH
    )
    assert r.status_code == 422 and ["body", "score"] in locs(r), r.text
