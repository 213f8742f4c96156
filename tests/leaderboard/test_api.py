"""The leaderboard REST API end to end on a real embedded Redis: updater, read side, generator,
auth, probes and metrics."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from services.leaderboard.app import create_app
from services.leaderboard.settings import LeaderboardSettings
from tests.leaderboard.conftest import AUTH, experiment, multipart, result, settings_for

API = "/api/v1/experiments"


def board_scores(client: TestClient, exp: str, **params: int) -> list[float]:
    r = client.get(f"{API}/{exp}/leaderboard", params=params)
    return [c["score"] for c in r.json()["candidates"]]


def test_auth_required_with_www_authenticate(client: TestClient) -> None:
    r = client.get(f"{API}", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    r = client.get(f"{API}", headers={"Authorization": ""})
    assert r.status_code == 401
    assert client.get(f"{API}").status_code == 200  # the fixture's client sends the token
    # Probes and metrics are outside /api/v1 and open.
    assert client.get("/livez", headers={"Authorization": ""}).status_code == 200
    assert client.get("/readyz", headers={"Authorization": ""}).json() == {"status": "ok"}
    spec = client.get("/api/v1/openapi.json").json()
    for path in (
        "/api/v1/experiments/{experiment_id}",
        "/api/v1/experiments/{experiment_id}/submissions",
        "/api/v1/experiments/{experiment_id}/leaderboard",
        "/api/v1/experiments/{experiment_id}/candidates/{candidate_id}",
        "/api/v1/experiments/{experiment_id}/candidates/{candidate_id}/files/{name}",
        "/api/v1/experiments/{experiment_id}/best",
        "/api/v1/experiments/{experiment_id}/lineage",
        "/api/v1/experiments/{experiment_id}/generate",
        "/api/v1/experiments/{experiment_id}/leases/{lease_id}",
    ):
        assert path in spec["paths"], path
    # Every schema reference resolves (the multipart result part is documented by hand).
    refs: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            refs.update(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec)
    schemas = spec["components"]["schemas"]
    # The lineage is a flat list (no recursive schema); the submission log is documented.
    assert "children" not in schemas["LineageNode"]["properties"]
    assert {"parent_id", "created_at", "env_steps"} <= set(schemas["LineageNode"]["properties"])
    log_op = spec["paths"]["/api/v1/experiments/{experiment_id}/submissions"]["get"]
    assert log_op["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SubmissionLog"
    }
    assert {p["name"] for p in log_op["parameters"]} >= {"after", "limit"}
    assert "#/components/schemas/SubmissionResult" in refs
    assert all(r.removeprefix("#/components/schemas/") in schemas for r in refs)
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_experiment_crud(client: TestClient) -> None:
    r = client.put(f"{API}/e1", json=experiment(top_k=3))
    assert r.status_code == 201
    assert r.json()["top_k"] == 3 and r.json()["experiment_id"] == "e1"
    r = client.put(f"{API}/e1", json=experiment(top_k=5))
    assert r.status_code == 200
    assert client.get(f"{API}/e1").json()["top_k"] == 5
    assert client.get(f"{API}").json() == ["e1"]
    client.post(f"{API}/e1/submissions", json=result("s0", 1.0))
    r = client.put(f"{API}/e1", json=experiment(top_k=5, higher_is_better=False))
    assert r.status_code == 409 and "higher_is_better" in r.json()["detail"]
    assert client.get(f"{API}/e1").json()["higher_is_better"] is True
    assert client.delete(f"{API}/e1").status_code == 204
    assert client.get(f"{API}/e1").status_code == 404
    assert client.get(f"{API}").json() == []


def test_updater_keeps_true_top_k_and_is_idempotent(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment(top_k=3))
    scores = [5.0, 1.0, 7.0, 3.0, 9.0, 2.0, 8.0]
    answers = [
        client.post(f"{API}/e/submissions", json=result(f"s{i}", s)).json()
        for i, s in enumerate(scores)
    ]
    assert [a["accepted"] for a in answers] == [True, True, True, True, True, False, True]
    assert answers[4]["rank"] == 1 and len(answers[4]["evicted"]) == 1
    assert "threshold" in answers[5]["reason"]
    board = client.get(f"{API}/e/leaderboard").json()
    assert [c["score"] for c in board["candidates"]] == [9.0, 8.0, 7.0]
    assert [c["rank"] for c in board["candidates"]] == [1, 2, 3]
    stats = board["stats"]
    assert stats["size"] == 3 and stats["score_max"] == 9.0 and stats["score_min"] == 7.0
    assert abs(stats["score_mean"] - 8.0) < 1e-9

    # A retry of an earlier submission gets the first answer, even though the board moved on.
    retry = client.post(f"{API}/e/submissions", json=result("s1", 100.0)).json()
    assert retry["duplicate"] is True
    assert {k: retry[k] for k in ("accepted", "candidate_id", "rank")} == {
        k: answers[1][k] for k in ("accepted", "candidate_id", "rank")
    }
    assert [c["score"] for c in client.get(f"{API}/e/leaderboard").json()["candidates"]] == [
        9.0,
        8.0,
        7.0,
    ]
    best = client.get(f"{API}/e/best").json()
    assert best["score"] == 9.0 and best["rank"] == 1 and best["status"] == "active"

    # A new best shows at once (rendered boards are reused only while unchanged), and
    # shrinking K through the config evicts the worst.
    client.post(f"{API}/e/submissions", json=result("s-new", 10.0))
    assert board_scores(client, "e") == [10.0, 9.0, 8.0]
    client.put(f"{API}/e", json=experiment(top_k=2))
    assert board_scores(client, "e") == [10.0, 9.0]
    assert board_scores(client, "e", limit=1) == [10.0]
    # Totals over decided submissions (the retry counted once) drive the orchestrator's budgets.
    summary = client.get(f"{API}/e").json()
    assert (summary["size"], summary["submissions"], summary["env_steps"]) == (2, 8, 8000)

    evicted_id = answers[1]["candidate_id"]
    detail = client.get(f"{API}/e/candidates/{evicted_id}").json()
    assert detail["status"] == "evicted" and detail["rank"] is None
    assert detail["evicted_at"] is not None

    # Lower-is-better experiments rank the other way round.
    client.put(f"{API}/loss", json=experiment(top_k=2, higher_is_better=False))
    for i, s in enumerate([3.0, 1.0, 2.0, 0.5]):
        client.post(f"{API}/loss/submissions", json=result(f"l{i}", s))
    assert [c["score"] for c in client.get(f"{API}/loss/leaderboard").json()["candidates"]] == [
        0.5,
        1.0,
    ]
    assert client.get(f"{API}/loss/best").json()["score"] == 0.5


def test_files_upload_download_and_lineage(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment(top_k=4))
    # The replay buffer spans many read chunks and write batches.
    replay = bytes(range(256)) * (5 * 4096 + 7)
    files = {
        "actor": b"actor-weights",
        "critic": b"critic-weights",
        "hparams": b'{"lr":1}',
        "replay_buffer": replay,
    }
    r = client.post(f"{API}/e/submissions", files=multipart(result("s0", 1.0, files), files))
    assert r.status_code == 200, r.text
    root_id = r.json()["candidate_id"]
    cand = client.get(f"{API}/e/candidates/{root_id}").json()
    assert set(cand["files"]) == set(files)
    for name, data in files.items():
        f = cand["files"][name]
        assert f["sha256"] == hashlib.sha256(data).hexdigest()
        got = client.get(f["download_path"])
        assert got.status_code == 200
        assert got.content == data
        assert got.headers["x-checkpoint-sha256"] == f["sha256"]

    manifest = client.post(f"{API}/e/generate", json={"pod_id": "pod-1"}).json()
    assert manifest["parent_id"] == root_id and manifest["generation"] == 1
    assert manifest["decision"] == "explore" and manifest["lease_id"]
    assert set(manifest["checkpoint"]["files"]) == set(files)
    for name, f in manifest["checkpoint"]["files"].items():  # the parent's weights, no copy
        assert f["sha256"] == cand["files"][name]["sha256"]
        assert f["uri"] == cand["files"][name]["uri"]
    child = result(
        "s1", 2.0, parent_id=root_id, generation=1, hyperparameters=manifest["hyperparameters"]
    )
    child_id = client.post(f"{API}/e/submissions", json=child).json()["candidate_id"]
    grandchild = result("s2", 3.0, parent_id=child_id, generation=2)
    grandchild["pod_id"], grandchild["env_steps"] = "pod-7", 12345
    gc_id = client.post(f"{API}/e/submissions", json=grandchild).json()["candidate_id"]
    other = client.post(f"{API}/e/submissions", json=result("s3", 0.5)).json()["candidate_id"]

    lineage = client.get(f"{API}/e/lineage").json()
    nodes = {n["candidate_id"]: n for n in lineage["nodes"]}
    assert list(nodes) == [root_id, child_id, gc_id, other]  # flat, oldest first
    assert "children" not in nodes[root_id]
    assert [n for n in nodes if nodes[n]["parent_id"] is None] == [root_id, other]
    assert (nodes[child_id]["parent_id"], nodes[gc_id]["parent_id"]) == (root_id, child_id)
    gc_node = nodes[gc_id]
    assert (gc_node["pod_id"], gc_node["env_steps"], gc_node["generation"]) == ("pod-7", 12345, 2)
    assert gc_node["submission_id"] == "s2" and gc_node["status"] == "active"
    assert gc_node["evicted_at"] is None and gc_node["created_at"] > 0
    # 4 inserts + the generator's exploit and explore decisions.
    assert lineage["events"] == 6
    client.put(f"{API}/other", json=experiment())
    assert client.delete(f"{API}/other/leases/{manifest['lease_id']}").status_code == 404
    assert client.delete(f"{API}/e/leases/{manifest['lease_id']}").status_code == 204
    assert client.delete(f"{API}/e/leases/{manifest['lease_id']}").status_code == 404


def test_generator_ensemble_and_strategies_over_http(client: TestClient) -> None:
    client.put(
        f"{API}/mix",
        json=experiment(top_k=8, algorithms={"ppo": 1.0, "sac": 3.0}),
    )
    # Empty board: pbt starts fresh, sampled inside the space.
    m = client.post(f"{API}/mix/generate", json={"pod_id": "p"}).json()
    assert m["checkpoint"] == "fresh" and m["decision"] == "fresh" and m["parent_id"] is None
    assert 1e-5 <= m["hyperparameters"]["lr"] <= 1e-2
    ids = {}
    for i, (algo, score) in enumerate([("ppo", 10.0), ("sac", 1.0), ("sac", 2.0)]):
        ids[i] = client.post(
            f"{API}/mix/submissions", json=result(f"s{i}", score, algorithm=algo)
        ).json()["candidate_id"]
    algos = []
    for i in range(200):
        m = client.post(f"{API}/mix/generate", json={"pod_id": f"p{i}"}).json()
        algos.append(m["algorithm"])
        # Exploit copies only within the pod's algorithm, even though ppo has the best score.
        parent = client.get(f"{API}/mix/candidates/{m['parent_id']}").json()
        assert parent["algorithm"] == m["algorithm"]
    share_sac = algos.count("sac") / len(algos)
    assert 0.62 < share_sac < 0.88  # weight 3:1 -> 0.75
    m = client.post(f"{API}/mix/generate", json={"pod_id": "x", "algorithm": "ppo"}).json()
    assert m["algorithm"] == "ppo" and m["parent_id"] == ids[0]
    r = client.post(f"{API}/mix/generate", json={"pod_id": "x", "algorithm": "dqn"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "algorithm"]

    client.put(f"{API}/rnd", json=experiment(strategy="random"))
    m = client.post(f"{API}/rnd/generate", json={"pod_id": "p"}).json()
    assert m["decision"] == "fresh" and m["strategy"] == "random"
    client.put(f"{API}/cem", json=experiment(strategy="cem"))
    for i in range(3):
        client.post(f"{API}/cem/submissions", json=result(f"c{i}", float(i)))
    m = client.post(f"{API}/cem/generate", json={"pod_id": "p"}).json()
    assert m["decision"] == "cem" and m["checkpoint"] == "fresh"


def test_a_seeded_generator_draws_alike_in_every_experiment(client: TestClient) -> None:
    """``options.seed``: a pod's draw depends on the seed, its id and the board, so two
    experiments (a benchmark's pbt and random arms) start their pods with the same draws."""

    def draws(exp: str, strategy: str, seed: int | None) -> list[dict]:
        options = {} if seed is None else {"seed": seed}
        client.put(f"{API}/{exp}", json=experiment(strategy=strategy, options=options))
        return [
            client.post(f"{API}/{exp}/generate", json={"pod_id": f"p{i}"}).json()["hyperparameters"]
            for i in range(4)
        ]

    pbt, rnd = draws("arm-pbt", "pbt", 7), draws("arm-random", "random", 7)
    assert pbt == rnd  # an empty board: both strategies draw fresh, alike
    assert len({json.dumps(h, sort_keys=True) for h in pbt}) == 4  # but pods differ
    assert draws("other-seed", "random", 8) != rnd
    unseeded = draws("u1", "random", None), draws("u2", "random", None)
    assert unseeded[0] != unseeded[1]
    # Once the board changes, so does the answer; the same board gives the same answer.
    client.post(f"{API}/arm-pbt/submissions", json=result("s1", 5.0))
    after = client.post(f"{API}/arm-pbt/generate", json={"pod_id": "p0"}).json()
    again = client.post(f"{API}/arm-pbt/generate", json={"pod_id": "p0"}).json()
    assert after["decision"] == "explore" and after["hyperparameters"] != pbt[0]
    assert after["parent_score"] == 5.0  # the pod compares it with its own score
    assert after["hyperparameters"] == again["hyperparameters"]
    # Two boards holding the same reports answer alike, though candidate ids are random.
    answers = []
    for exp in ("same-a", "same-b"):
        client.put(f"{API}/{exp}", json=experiment(options={"seed": 7}))
        client.post(f"{API}/{exp}/submissions", json=result(f"{exp}-s", 5.0, pod_id="p0"))
        answers.append(client.post(f"{API}/{exp}/generate", json={"pod_id": "p1"}).json())
    assert answers[0]["parent_id"] != answers[1]["parent_id"]
    assert answers[0]["hyperparameters"] == answers[1]["hyperparameters"]
    # With `truncation`, a pod asking with its score is told to keep unless it is among the
    # worst; keeping logs nothing.
    client.put(f"{API}/trunc", json=experiment(options={"truncation": 0.5}))
    for i, score in enumerate([10.0, 20.0, 30.0, 40.0]):
        client.post(f"{API}/trunc/submissions", json=result(f"t{i}", score, pod_id=f"p{i}"))
    events = client.get(f"{API}/trunc/lineage").json()["events"]
    keep = client.post(f"{API}/trunc/generate", json={"pod_id": "p2", "score": 30.0}).json()
    assert keep["decision"] == "keep" and keep["parent_id"] is None and keep["lease_id"] is None
    assert client.get(f"{API}/trunc/lineage").json()["events"] == events
    worst = client.post(f"{API}/trunc/generate", json={"pod_id": "p1", "score": 20.0}).json()
    assert worst["decision"] == "explore" and worst["parent_score"] == 40.0  # top quarter
    r = client.post(f"{API}/trunc/generate", json={"pod_id": "p1", "score": "NaN"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "score"]
    r = client.put(f"{API}/bad", json=experiment(options={"seed": "x"}))
    assert r.status_code == 422 and "seed" in r.text


def test_board_stats_are_mean_variance_covariance(client: TestClient) -> None:
    client.put(f"{API}/s", json=experiment(top_k=5))
    rng = np.random.default_rng(0)
    rows = []
    for i in range(8):
        h = {
            "lr": float(10 ** rng.uniform(-5, -2)),
            "gamma": float(rng.uniform(0.9, 0.999)),
            "batch_size": 64,
            "epochs": int(rng.integers(1, 11)),
        }
        rows.append((float(i), h))
        client.post(f"{API}/s/submissions", json=result(f"s{i}", float(i), hyperparameters=h))
    stats = client.get(f"{API}/s/leaderboard").json()["stats"]["hyperparameters"]
    top = [h for _, h in sorted(rows, key=lambda t: -t[0])[:5]]
    x = np.array([[h[n] for n in stats["names"]] for h in top])
    assert stats["names"] == ["lr", "gamma", "epochs"]
    np.testing.assert_allclose(
        [stats["mean"][n] for n in stats["names"]], x.mean(axis=0), rtol=1e-9
    )
    np.testing.assert_allclose(stats["covariance"], np.cov(x, rowvar=False, ddof=0), rtol=1e-9)
    np.testing.assert_allclose(
        [stats["variance"][n] for n in stats["names"]], x.var(axis=0), rtol=1e-9
    )


def algorithm_bests(client: TestClient, experiment_id: str) -> dict[str, float]:
    """The experiment's ``podium_leaderboard_algorithm_top_score`` series, as scraped."""
    text = client.get("/metrics", headers={"Authorization": ""}).text
    return {
        s.labels["algorithm"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "podium_leaderboard_algorithm_top_score"
        and s.labels["experiment"] == experiment_id
    }


def test_an_ensembles_best_of_each_algorithm_below_the_exported_ranks(tmp_path: Path) -> None:
    """With fewer ranks exported than the board holds, each algorithm's best is still read
    (further down an ensemble's board), and only the experiment's own algorithms label it."""
    settings = settings_for(tmp_path / "data", metrics_top_ranks=1)
    with TestClient(create_app(settings), headers=AUTH) as c:
        c.put(f"{API}/ens", json=experiment(top_k=8, algorithms={"ppo": 1.0, "sac": 1.0}))
        for i, (score, algorithm) in enumerate([(5.0, "ppo"), (4.0, "ppo"), (3.0, "sac")]):
            c.post(f"{API}/ens/submissions", json=result(f"e{i}", score, algorithm=algorithm))
        # An algorithm of no experiment's ensemble is refused, so it labels no series.
        refused = c.post(f"{API}/ens/submissions", json=result("e3", 2.0, algorithm="td3"))
        assert refused.status_code == 422 and "algorithm" in refused.text
        assert algorithm_bests(c, "ens") == {"ppo": 5.0, "sac": 3.0}
        text = c.get("/metrics", headers={"Authorization": ""}).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    ranks = [s.labels["rank"] for s in samples if s.name == "podium_leaderboard_rank_score"]
    assert ranks == ["1"]


def test_metrics_exposed_with_bounded_labels(client: TestClient) -> None:
    client.put(f"{API}/m", json=experiment(top_k=2))
    for i, s in enumerate([1.0, 2.0, 3.0, 0.5]):
        client.post(f"{API}/m/submissions", json=result(f"s{i}", s))
    client.post(f"{API}/m/generate", json={"pod_id": "p"})
    client.get(f"{API}/m/leaderboard")
    # Read back with prometheus-client's exposition-format parser (what a scraper reads).
    text = client.get("/metrics", headers={"Authorization": ""}).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("podium_leaderboard_top_score", experiment="m") == 3.0
    assert value("podium_leaderboard_size", experiment="m") == 2.0
    assert value("podium_leaderboard_rank_score", experiment="m", rank="2") == 2.0
    top = "podium_leaderboard_algorithm_top_score"
    assert value(top, experiment="m", algorithm="ppo") == 3.0
    # An ensemble: each algorithm's best on the board, however low it ranks.
    client.put(f"{API}/ens", json=experiment(top_k=3, algorithms={"ppo": 1.0, "sac": 1.0}))
    for i, (s, algorithm) in enumerate([(5.0, "ppo"), (4.0, "ppo"), (3.0, "ppo"), (1.0, "sac")]):
        client.post(f"{API}/ens/submissions", json=result(f"e{i}", s, algorithm=algorithm))
    assert algorithm_bests(client, "ens") == {"ppo": 5.0}  # SAC's did not make the top 3
    client.post(f"{API}/ens/submissions", json=result("e9", 4.5, algorithm="sac"))
    assert algorithm_bests(client, "ens") == {"ppo": 5.0, "sac": 4.5}
    sub = "podium_leaderboard_submissions_total"
    assert value(sub, experiment="m", outcome="inserted") == 3
    assert value(sub, experiment="m", outcome="rejected") == 1
    assert value("podium_leaderboard_evictions_total", experiment="m") == 1
    decisions = "podium_leaderboard_generator_decisions_total"
    assert value(decisions, experiment="m", strategy="pbt", decision="explore") == 1
    route = "/api/v1/experiments/{experiment_id}/leaderboard"
    latency = "podium_leaderboard_request_duration_seconds_count"
    assert value(latency, method="GET", route=route, status="200") == 1
    # Bounded labels: only these label names, no raw paths, no candidate or submission ids.
    label_names = {k for _, labels in samples for k, _ in labels}
    assert label_names <= {
        "experiment",
        "outcome",
        "strategy",
        "decision",
        "rank",
        "algorithm",
        "method",
        "route",
        "status",
        "le",
    }
    routes = {v for _, labels in samples for k, v in labels if k == "route"}
    assert all(
        "{" in r or r in ("/metrics", "/livez", "/readyz", "/api/v1/experiments") for r in routes
    ), routes


def test_a_replica_drops_the_series_of_an_experiment_deleted_through_another(
    lb_settings: LeaderboardSettings,
) -> None:
    """Two replicas on one Redis: after a DELETE served by one, the other's next scrape has no
    series of the deleted experiment (its counters included); the rest stay."""

    def experiments(c: TestClient) -> set[str]:
        text = c.get("/metrics").text
        return {
            s.labels["experiment"]
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("podium_leaderboard_") and "experiment" in s.labels
        }

    with (
        TestClient(create_app(lb_settings), headers=AUTH) as a,
        TestClient(create_app(lb_settings), headers=AUTH) as b,
    ):
        for exp in ("gone", "kept"):
            assert a.put(f"{API}/{exp}", json=experiment()).status_code in (200, 201)
            b.post(f"{API}/{exp}/submissions", json=result(f"{exp}-1", 1.0))
            b.post(f"{API}/{exp}/generate", json={"pod_id": "p"})
        assert experiments(b) == {"gone", "kept"}
        assert a.delete(f"{API}/gone").status_code == 204
        assert experiments(b) == {"kept"}
        assert experiments(a) == {"kept"}


def test_rank_gauges_stop_at_metrics_top_ranks(client: TestClient) -> None:
    client.put(f"{API}/big", json=experiment(top_k=40))
    for i in range(25):
        client.post(f"{API}/big/submissions", json=result(f"b{i}", float(i)))
    text = client.get("/metrics").text
    ranks = {
        int(s.labels["rank"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "podium_leaderboard_rank_score" and s.labels["experiment"] == "big"
    }
    assert ranks == set(range(1, 11))  # the default metrics_top_ranks, not K
    assert 'podium_leaderboard_size{experiment="big"} 25.0' in text


def test_token_from_file(tmp_path) -> None:
    from services.leaderboard.app import create_app
    from services.leaderboard.settings import LeaderboardSettings

    secret = tmp_path / "token"
    secret.write_text("from-secret\n")
    app = create_app(LeaderboardSettings(data_dir=tmp_path / "d", api_token_file=secret))
    with TestClient(app) as c:
        assert c.get(f"{API}", headers={"Authorization": "Bearer from-secret"}).status_code == 200
        assert c.get(f"{API}", headers=AUTH).status_code == 401


def test_lineage_of_a_chain_deeper_than_nested_json_allows(client: TestClient) -> None:
    """A PBT chain of 320 generations (each agent descends from the previous one): the flat
    lineage serializes it, and the tree rebuilt from parent_id has that depth."""
    client.put(f"{API}/deep", json=experiment(top_k=2))
    parent = None
    ids = []
    for g in range(320):
        r = client.post(
            f"{API}/deep/submissions",
            json=result(f"d{g}", float(g), parent_id=parent, generation=g),
        )
        assert r.status_code == 200 and r.json()["accepted"], r.text
        parent = r.json()["candidate_id"]
        ids.append(parent)
    r = client.get(f"{API}/deep/lineage")
    assert r.status_code == 200, r.text[:300]
    nodes = r.json()["nodes"]
    assert [n["candidate_id"] for n in nodes] == ids
    parent_of = {n["candidate_id"]: n["parent_id"] for n in nodes}
    depth, cid = 0, ids[-1]
    while cid is not None:
        depth, cid = depth + 1, parent_of[cid]
    assert depth == 320
    assert [n["status"] for n in nodes[-3:]] == ["evicted", "active", "active"]
    assert nodes[0]["evicted_at"] >= nodes[0]["created_at"]


def test_submission_log_pages_through_every_decided_report(client: TestClient) -> None:
    client.put(f"{API}/log", json=experiment(top_k=2))
    scores = [3.0, 1.0, 5.0, 2.0, 4.0, 0.5, 6.0]
    parent = ""
    for i, s in enumerate(scores):
        answer = client.post(
            f"{API}/log/submissions",
            json=result(
                f"r{i}",
                s,
                pod_id=f"pod-{i % 3}",
                env_steps=100 * (i + 1),
                parent_id=parent if i == 3 else None,
                generation=i,
            ),
        )
        parent = parent or answer.json()["candidate_id"]  # a parent of this experiment's
        client.post(f"{API}/log/generate", json={"pod_id": "g"})  # interleaved decisions
    client.post(f"{API}/log/submissions", json=result("r1", 99.0))  # a retry: not logged again
    whole = client.get(f"{API}/log/submissions").json()
    assert whole["next_after"] is None
    subs = whole["submissions"]
    assert [s["submission_id"] for s in subs] == [f"r{i}" for i in range(7)]
    assert [s["score"] for s in subs] == scores
    assert [s["accepted"] for s in subs] == [True, True, True, False, True, False, True]
    assert [s["env_steps"] for s in subs] == [100 * (i + 1) for i in range(7)]
    assert sum(s["env_steps"] for s in subs) == client.get(f"{API}/log").json()["env_steps"]
    assert [s["pod_id"] for s in subs] == [f"pod-{i % 3}" for i in range(7)]
    rejected = subs[3]
    assert rejected["candidate_id"] is None and rejected["parent_id"] == parent
    assert rejected["generation"] == 3
    board = {c["candidate_id"] for c in client.get(f"{API}/log/lineage").json()["nodes"]}
    assert {s["candidate_id"] for s in subs if s["accepted"]} == board
    assert all(a["decided_at"] <= b["decided_at"] for a, b in itertools.pairwise(subs))

    pages, after = [], None
    while True:
        params: dict[str, object] = {"limit": 3}
        if after:
            params["after"] = after
        page = client.get(f"{API}/log/submissions", params=params).json()
        pages.append([s["submission_id"] for s in page["submissions"]])
        after = page["next_after"]
        if after is None:
            break
    assert pages[:3] == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    assert all(p == [] for p in pages[3:]) and len(pages) <= 4

    assert client.get(f"{API}/log/submissions", params={"after": "x"}).status_code == 422
    assert client.get(f"{API}/log/submissions", params={"limit": 0}).status_code == 422
    assert client.get(f"{API}/nope/submissions").status_code == 404


def test_a_parent_from_another_experiment_is_refused(client: TestClient) -> None:
    """A report whose ``parent_id`` named another experiment's candidate was
    accepted, so one experiment's lineage pointed into another's."""
    for exp in ("mine", "theirs"):
        assert client.put(f"{API}/{exp}", json=experiment(top_k=4)).is_success
    theirs = client.post(f"{API}/theirs/submissions", json=result("t0", 1.0)).json()
    mine = client.post(f"{API}/mine/submissions", json=result("m0", 1.0)).json()
    for parent in (theirs["candidate_id"], "c-never-existed"):
        r = client.post(
            f"{API}/mine/submissions", json=result("m1", 2.0, parent_id=parent, generation=1)
        )
        assert r.status_code == 422, r.text
        (problem,) = r.json()["detail"]
        assert problem["loc"][-1] == "parent_id" and "mine" in problem["msg"]
    # Nothing was decided: the board, the lineage, the log and the budget are untouched, and
    # the same report with this experiment's own parent is taken.
    nodes = client.get(f"{API}/mine/lineage").json()["nodes"]
    assert [n["candidate_id"] for n in nodes] == [mine["candidate_id"]]
    assert len(client.get(f"{API}/mine/submissions").json()["submissions"]) == 1
    assert client.get(f"{API}/mine").json()["env_steps"] == 1000
    ok = client.post(
        f"{API}/mine/submissions",
        json=result("m1", 2.0, parent_id=mine["candidate_id"], generation=1),
    )
    assert ok.status_code == 200 and ok.json()["accepted"], ok.text
    # An evicted candidate is still this experiment's: a parent it may name.
    for i in range(4):
        client.post(f"{API}/mine/submissions", json=result(f"m-fill{i}", 10.0 + i))
    evicted = client.post(
        f"{API}/mine/submissions",
        json=result("m2", 0.5, parent_id=mine["candidate_id"], generation=1),
    )
    assert evicted.status_code == 200 and not evicted.json()["accepted"]
