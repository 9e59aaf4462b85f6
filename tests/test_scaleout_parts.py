"""The parts of `serve --ray` that need no cluster: prefix hashes, the shared suffix log, merged metrics."""

from __future__ import annotations

import json

import pytest

from specstack.drafters.suffix import SuffixConfig, SuffixDrafter
from specstack.errors import InvalidParameterError
from specstack.server.scaleout.metrics_merge import merge
from specstack.server.scaleout.prefix import CHUNK, chain, matched, published
from specstack.server.scaleout.suffix_share import BUDGET_TOKENS, OutputWindow, SuffixLog, feed, suffix_drafters


def test_a_prefix_matches_by_whole_chunks_and_only_from_the_start():
    held = set(published([list(range(100))]))
    assert matched(chain(list(range(100)) + [7, 8, 9]), held) == (100 // CHUNK) * CHUNK
    assert matched(chain(list(range(40))), held) == 2 * CHUNK
    assert matched(chain([1] + list(range(1, 100))), held) == 0  # the first chunk differs: nothing reusable
    assert matched(chain(list(range(CHUNK - 1))), held) == 0  # shorter than a chunk: no hash at all
    shifted = chain(list(range(CHUNK, 2 * CHUNK)))  # the same tokens at another position: another prefix
    assert not set(shifted) & held


def test_published_hashes_are_capped_newest_sequences_first():
    seqs = [[i] * (4 * CHUNK) for i in range(10)]
    out = published(seqs, limit=8)
    assert len(out) == 8 and out[:4] == chain(seqs[0])


def test_replicas_matching_equally_go_by_queue_length_then_by_a_stable_hash():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'specstack[ray]' (CI does)")
    import asyncio
    import types

    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    from specstack.server.scaleout.router import PrefixRouter

    system = list(range(3 * CHUNK))  # a system prompt every replica holds: every request ties
    deployment = DeploymentID(name="role-m", app_name="specstack")
    replicas = [types.SimpleNamespace(replica_id=ReplicaID(unique_id=f"r{i}", deployment_id=deployment),
                                      routing_stats={"version": 1, "prefixes": published([system])})
                for i in range(4)]
    lens: dict[str, int | None] = {r.replica_id.unique_id: 0 for r in replicas}

    async def queue_lens(candidates):
        return {r.replica_id: lens[r.replica_id.unique_id] for r in candidates}

    router = PrefixRouter.__new__(PrefixRouter)  # only what ``_prefix_holder`` reads; no Serve
    router._min_match, router._balance_abs, router._balance_rel = 2 * CHUNK, 2, 1.5
    router._published, router._recent, router._queue_lens = {}, {}, queue_lens

    def route(prompt: list[int]) -> str:
        return asyncio.run(router._prefix_holder(replicas, chain(prompt))).replica_id.unique_id

    prompts = [system + [1000 + i] * CHUNK for i in range(64)]
    chosen = [route(p) for p in prompts]
    assert set(chosen) == set(lens)  # equal queues: spread over every replica (all on one: p < 1e-7)
    assert [route(p) for p in prompts] == chosen  # and the same prompt to the same replica
    lens.update(r0=1, r1=1, r2=None, r3=0)  # the shortest queue wins; an unknown one counts as longest
    assert {route(p) for p in prompts} == {"r3"}
    lens.update(r3=2)
    assert {route(p) for p in prompts} == {"r0", "r1"}
    replicas[2].routing_stats = {"version": 2, "prefixes": published([prompts[0]])}  # r2 holds more of it
    assert route(prompts[0]) == "r2"


def test_the_suffix_log_serves_deltas_and_reloads_its_checkpoint(tmp_path):
    path = tmp_path / "log.json"
    log = SuffixLog(str(path), budget_tokens=10, vocab="v1")
    assert log.add("a", [1, 2], [3, 4]) == 1
    log.add("b", [5], [6, 7])
    version, new = log.since(1)
    assert version == 2 and new == [("b", [5], [6, 7])]
    log.add("a", [8, 9], [10, 11])  # 11 tokens: the oldest entry goes
    assert [o for _, _, o in log.since(0)[1]] == [[6, 7], [10, 11]]
    log.save()
    assert not list(tmp_path.glob(".log.json.*"))  # written through a temporary file, renamed
    again = SuffixLog(str(path), budget_tokens=10, vocab="v1")
    assert again.since(0) == log.since(0) and again.add("c", [1], [2]) == 4
    with pytest.raises(InvalidParameterError, match="another vocabulary"):
        SuffixLog(str(path), vocab="v2")
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(InvalidParameterError, match="not a specstack suffix log"):
        SuffixLog(str(path))


def test_a_replica_keeps_the_outputs_it_pulled_within_the_logs_budget(monkeypatch):
    import asyncio
    import types

    from specstack.server.scaleout import replica as replica_mod

    assert OutputWindow().budget == SuffixLog().budget == BUDGET_TOKENS
    window = OutputWindow(budget_tokens=10)
    window.extend([([1, 2], [3, 4]), ([5], [6, 7])])
    window.extend([([8, 9], [10, 11])])  # 11 tokens: the oldest goes, as in the log
    assert list(window) == [([5], [6, 7]), ([8, 9], [10, 11])] and window.tokens == 7
    window.extend([(list(range(20)), [1])])  # one output over the budget alone: kept, the others go
    assert len(window) == 1

    # a replica's pulls: whatever the log serves, what it keeps stays within the budget (the newest kept)
    monkeypatch.setattr(replica_mod, "OutputWindow", lambda: OutputWindow(budget_tokens=100))
    served = [("other", [i] * 5, [i] * 5) for i in range(50)]  # 500 tokens from another replica

    async def since(version):
        return len(served), served[version:]

    class Bare(replica_mod.RoleReplica):  # no engine, no Serve: only what ``pull`` touches
        def __init__(self) -> None:
            pass

        def __del__(self) -> None:
            pass

    async def run() -> None:
        r = Bare()
        r.id, r.role, r._loop = "me", types.SimpleNamespace(name="m"), asyncio.get_running_loop()
        r._log = types.SimpleNamespace(since=types.SimpleNamespace(remote=since))
        r.worker = types.SimpleNamespace(_drafters={}, on_engine_thread=lambda fn: fn())
        r._shared = replica_mod.Gauge("shared", "h", ["role"], registry=replica_mod.ServerMetrics().registry)
        r._version, r._pulled, r._remote_outputs, r._seeded = 0, 0, replica_mod.OutputWindow(), set()
        assert await r.pull() == 50
        served.extend(("other", [7], [7]) for _ in range(10))
        assert await r.pull() == 10
        assert r._remote_outputs.tokens <= 100 and list(r._remote_outputs)[-1] == ([7], [7])
        assert r._shared.labels("m")._value.get() == 60  # the gauge counts every output pulled

    asyncio.run(run())


def test_another_replicas_output_feeds_the_suffix_trees_as_their_own_end_would():
    mine = SuffixDrafter(SuffixConfig())
    mine.begin([1, 2, 3])
    mine.advance([4, 5, 6, 7], 0)
    mine.end()
    other = SuffixDrafter(SuffixConfig())
    feed(other, [1, 2, 3], [4, 5, 6, 7])
    assert other.global_tree.n_tokens == mine.global_tree.n_tokens
    for d in (mine, other):  # a new request drafts from the global tree: the earlier output's continuation
        d.begin([9, 8, 1, 2, 3, 4])
    assert other.propose_chain([9, 8, 1, 2, 3, 4], 3).token_ids == mine.propose_chain([9, 8, 1, 2, 3, 4], 3).token_ids
    assert other.propose_chain([9, 8, 1, 2, 3, 4], 3).token_ids == (5, 6, 7)
    from specstack.drafters.cascade import CascadeConfig, CascadeDrafter
    from specstack.drafters.none import NoDrafter

    assert suffix_drafters([CascadeDrafter([other, NoDrafter()], CascadeConfig(("suffix", "none"))), mine]) == [mine, other]


def test_metrics_merge_labels_each_replica_and_sums_a_total():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    texts = {}
    for replica, n in (("r1", 3), ("r2", 4)):
        reg = CollectorRegistry()
        Counter("specstack_generation_tokens", "t", ["role"], registry=reg).labels("m").inc(n)
        Histogram("specstack_ttft", "h", ["role"], buckets=(1.0,), registry=reg).labels("m").observe(0.5)
        texts[replica] = generate_latest(reg).decode()
    out = merge(texts).decode()
    assert 'specstack_generation_tokens_total{replica="r1",role="m"} 3.0' in out
    assert 'specstack_generation_tokens_total{replica="total",role="m"} 7.0' in out
    assert 'specstack_ttft_bucket{le="1.0",replica="total",role="m"} 2.0' in out
    assert "_created" not in out


def test_health_waits_for_every_replica_once_then_counts_them():
    import asyncio

    from specstack.server.roles import default_roles
    from specstack.server.scaleout.remote import RemoteRole
    from specstack.server.scaleout.suffix_share import MetricsBoard

    board = MetricsBoard()

    class Local(RemoteRole):  # the board in this process, not an actor
        async def _ask_board(self, method, *args):
            return getattr(board, method)(*args)

    role = Local(default_roles()[0], handle=None, replicas=2)

    async def run() -> None:
        assert await role.health() == ("Loading model (0/2 replicas ready)", {"replicas_ready": "0/2"})
        board.put("a", "")
        assert await role.health() == ("Loading model (1/2 replicas ready)", {"replicas_ready": "1/2"})
        board.put("b", "")
        assert await role.health() == (None, {"replicas_ready": "2/2"})
        board.texts["b"] = (board.texts["b"][0] - 60, "")  # silent for a minute: gone; the server still serves
        assert await role.health() == (None, {"replicas_ready": "1/2"})
        board.texts.clear()
        assert (await role.health())[0] == "no replica is running; Serve is replacing them"

    asyncio.run(run())


def test_a_draining_front_waits_for_requests_in_flight_and_refuses_new_ones():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'specstack[ray]' (CI does)")
    import asyncio

    from specstack.server.scaleout.deploy import InFlight

    async def run() -> None:
        started, release = asyncio.Event(), asyncio.Event()

        async def app(scope, receive, send):  # a response still being sent (a stream, or a request queued for a slot)
            started.set()
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        def sink(into: list):
            async def send(message):
                into.append(message)
            return send

        front, scope = InFlight(app, retry_after_s=3), {"type": "http", "method": "POST", "path": "/v1/completions",
                                                         "headers": []}
        served, refused = [], []
        task = asyncio.create_task(front(scope, receive, sink(served)))
        await started.wait()
        assert front.active == 1
        front.draining = True
        await front(scope, receive, sink(refused))
        assert refused[0]["status"] == 503 and (b"retry-after", b"3") in refused[0]["headers"]
        assert json.loads(refused[1]["body"])["error"]["code"] == "shutting_down"
        assert front.active == 1  # the request in flight still counts until its response is sent
        release.set()
        await task
        assert front.active == 0 and served[0]["status"] == 200

    asyncio.run(run())
