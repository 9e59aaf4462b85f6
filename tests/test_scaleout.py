"""`specstack serve --ray`: the same API from Ray Serve replicas, on a 2-node local cluster (1 CPU each).

One module-scoped cluster and one deployment of the bundled pair: 2 replicas of one thread and 2 slots each,
a queue of 1.  Skips, saying why, where Ray Serve is not installed (CI installs the ``ray`` extra).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'specstack[ray]' (CI does)")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'specstack[ray]' (CI does)")

from fastapi.testclient import TestClient  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from specstack.bench.serving import free_port, wait_ready  # noqa: E402
from specstack.prompts import held_out_prompts  # noqa: E402
from specstack.server.app import Limits, create_app  # noqa: E402
from specstack.server.roles import default_roles  # noqa: E402
from specstack.server.scaleout import deploy  # noqa: E402

PROMPTS = held_out_prompts(4)
FRESH = held_out_prompts(8)[5:]  # no other test sends these: no replica holds their prefix before
MODEL = "pycoder-6m"
WAIT_S = 120  # a deadline against hanging, never a performance bound
# Ray Serve starts a killed replica's successor only once the dead one's CPU is free again; on a busy 2-core CI
# machine that once took longer than WAIT_S (at c675382), so the wait for it is a hang guard of its own.
REPLACE_S = 600


def roles():
    # --exact on: outputs are compared bit for bit with the single-process server's
    return default_roles(parallel=2, exact="on", threads=1)


LIMITS = Limits(max_tokens=512, max_body_bytes=64_000)


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    temp = os.path.join(os.environ["RAY_TMPDIR"], "ray")  # its address file too, not the shared /tmp/ray
    os.makedirs(temp)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 << 20,
                                                      "include_dashboard": False, "temp_dir": temp})
    c.add_node(num_cpus=1, object_store_memory=100 << 20, temp_dir=temp)
    yield c
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        c.shutdown()
        shutil.rmtree(os.environ.pop("RAY_TMPDIR"), ignore_errors=True)


@pytest.fixture(scope="module")
def suffix_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("suffix-log")


@pytest.fixture(scope="module")
def url(cluster, suffix_dir):
    port = free_port()
    app = deploy.application(roles(), LIMITS, max_queue=1, replicas=2, suffix_log=suffix_dir)
    deploy.start(app, cluster.address, "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, timeout=WAIT_S, interval=0.5)
    return base


@pytest.fixture(scope="module")
def single():
    with TestClient(create_app(roles(), LIMITS, max_queue=4)) as client:
        deadline = time.time() + WAIT_S
        while client.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.2)
        yield client


def complete(url: str, prompt: str, n: int = 32, session: str | None = None, **extra) -> dict:
    headers = {"x-session-id": session} if session else {}
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                                  **extra}, headers=headers, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return 0.0


def wait_metric(url: str, name: str, ok, **labels: str) -> float:
    deadline = time.time() + WAIT_S
    while time.time() < deadline:
        value = metric(httpx.get(url + "/metrics").text, name, **labels)
        if ok(value):
            return value
        time.sleep(0.5)
    raise AssertionError(f"{name}{labels} never became as expected")


def test_greedy_outputs_equal_the_single_process_server(url, single):
    for prompt in PROMPTS[:3]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0}
        ray_r, one = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S).json(), \
            single.post("/v1/completions", json=body).json()
        assert ray_r["choices"][0]["text"] == one["choices"][0]["text"]
        assert ray_r["usage"] == one["usage"]
        assert ray_r["speculative"]["n_drafted"] > 0 and ray_r["speculative"]["replica"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "A stack class."}], "max_tokens": 24,
            "temperature": 0}
    assert (httpx.post(url + "/v1/chat/completions", json=chat, timeout=WAIT_S).json()["choices"][0]["message"]
            == single.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"])
    # streaming: the same text, chunk by chunk, then [DONE]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=WAIT_S) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1]) == one["choices"][0]["text"]


def test_errors_are_the_single_process_servers(url, single):
    for body in ({"model": MODEL, "prompt": "x", "n": 99}, {"model": MODEL, "prompt": "x", "repeat_penalty": 0.0},
                 {"model": MODEL, "prompt": "x", "max_tokens": 10_000},
                 {"model": MODEL, "prompt": "x", "speculative": {"drafter": "bogus"}}):
        a, b = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S), single.post("/v1/completions", json=body)
        assert (a.status_code, a.json()) == (b.status_code, b.json())
    models = httpx.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["speculative"]["exact"]["mode"] == "on"


def sessions_by_replica(url: str, n: int = 12) -> dict[str, str]:
    """Each of ``n`` sessions' replica, asked with prompts too short to match any prefix (< 32 tokens)."""
    return {f"s{i}": complete(url, f"def f{i}(x):\n", 4, session=f"s{i}")["speculative"]["replica"] for i in range(n)}


def test_a_session_stays_on_its_replica(url):
    first = sessions_by_replica(url)
    for i in range(3):
        again = {s: complete(url, f"class C{i}{s}:\n", 4, session=s)["speculative"]["replica"] for s in first}
        assert again == first
    assert len(set(first.values())) == 2  # 12 sessions over 2 replicas: both used (all on one: p = 2^-11)


def test_a_returning_conversation_goes_to_the_replica_holding_its_prefix(url):
    # Each conversation starts on one replica (its session's) and comes back under a session of the other:
    # the prefix outranks the session, so it returns where its KV is (session or pow2 routing would not).
    owners = sessions_by_replica(url)
    by_replica = {r: s for s, r in owners.items()}
    assert len(by_replica) == 2
    (a, on_a), (b, on_b) = sorted(by_replica.items())
    for i, (start, back, holder) in enumerate(((on_a, on_b, a), (on_b, on_a, b), (on_a, on_b, a))):
        head = FRESH[i][:500]
        r1 = complete(url, head, 24, session=start)
        assert r1["speculative"]["replica"] == holder
        r2 = complete(url, head + r1["choices"][0]["text"] + f"\n# turn {i}\n", 8, session=back)
        assert r2["speculative"]["replica"] == holder
        assert r2["speculative"]["reused_prompt_tokens"] >= r1["usage"]["prompt_tokens"] - 16


def test_outputs_finished_on_one_replica_raise_suffix_acceptance_on_the_other(url):
    owners = sessions_by_replica(url)
    a, b = sorted(set(owners.values()))
    on_a = next(s for s, r in owners.items() if r == a)
    on_b = next(s for s, r in owners.items() if r == b)
    spec = {"drafter": "suffix", "k_policy": "fixed", "k": 8}
    seen, fresh = "def walk(tree):\n", "def parse(text):\n"  # short: routed by session, not prefix
    complete(url, seen, 64, session=on_a, speculative=spec)
    before = metric(httpx.get(url + "/metrics").text, "specstack_suffix_shared_outputs", role=MODEL, replica=b)
    wait_metric(url, "specstack_suffix_shared_outputs", lambda v: v > before, role=MODEL, replica=b)
    shared = complete(url, seen, 64, session=on_b, speculative=spec)["speculative"]
    cold = complete(url, fresh, 64, session=on_b, speculative=spec)["speculative"]
    assert shared["replica"] == cold["replica"] == b
    assert shared["n_accepted"] > cold["n_accepted"] and shared["acceptance_rate"] > 0.9


def test_metrics_per_replica_and_total(url):
    text = httpx.get(url + "/metrics").text
    replicas = set(re.findall(r'replica="([^"]+)"', text)) - {"total", "ingress"}  # ingress: its own refusals
    assert len(replicas) == 2
    per = [metric(text, "specstack_generation_tokens_total", role=MODEL, replica=r) for r in replicas]
    assert all(v > 0 for v in per)
    assert metric(text, "specstack_generation_tokens_total", role=MODEL, replica="total") == sum(per)


def test_metrics_and_health_answer_while_every_slot_and_the_queue_are_taken(url):
    # 6 clients in a closed loop on 2 x 2 slots and a queue of 1: every slot busy, the queue full (the rest 429).
    # /metrics and /health read the replicas' board, not through the slots: each answers 200 at once (a call
    # through the deployment's handle would wait for a slot, or be refused with the queue full: a plain 500).
    stop, codes = threading.Event(), []

    def client(i: int) -> None:
        with httpx.Client(timeout=WAIT_S) as c:
            while not stop.is_set():
                codes.append(c.post(url + "/v1/completions", json={
                    "model": MODEL, "prompt": f"# {i}\n" + PROMPTS[i % 4], "max_tokens": 200,
                    "temperature": 0}).status_code)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    answers = []

    def busy(m: httpx.Response) -> float:
        return metric(m.text, "specstack_busy_slots", role=MODEL, replica="total") if m.status_code == 200 else 0.0

    try:
        time.sleep(0.5)
        # At least 2.5 s (past one push of the replicas' metrics, every 2 s), and until a push under load arrived:
        # a deadline against hanging, not a bound on how fast the figures come.
        start, deadline = time.time(), time.time() + WAIT_S
        with httpx.Client(timeout=WAIT_S) as c:
            while time.time() < deadline and (time.time() - start < 2.5 or not any(busy(m) > 0 for m, _ in answers)):
                answers.append((c.get(url + "/metrics"), c.get(url + "/health")))
                time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert 429 in codes  # the queue was full meanwhile
    assert all(m.status_code == 200 and h.status_code == 200 for m, h in answers)
    assert all(h.json()["roles"][MODEL]["replicas_ready"] == "2/2" for _, h in answers)
    for m, _ in answers:
        assert len(set(re.findall(r'replica="([^"]+)"', m.text)) - {"total", "ingress"}) == 2
    assert max(busy(m) for m, _ in answers) > 0


def test_a_disconnect_frees_the_slot(url):
    before = metric(httpx.get(url + "/metrics").text, "specstack_requests_total", role=MODEL, status="cancelled",
                    replica="total")
    with httpx.stream("POST", url + "/v1/completions", timeout=WAIT_S,
                      json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if '"text"' in line:
                break  # leave mid-stream
    wait_metric(url, "specstack_requests_total", lambda v: v > before, role=MODEL, status="cancelled", replica="total")
    wait_metric(url, "specstack_busy_slots", lambda v: v == 0, role=MODEL, replica="total")


def test_past_every_queue_the_answer_is_429_with_retry_after(url):
    # 2 replicas x 2 slots, 1 queue place: of 8 long requests at once, some must be refused
    results: list[httpx.Response] = []

    def one(i: int) -> None:
        results.append(httpx.post(url + "/v1/completions", timeout=WAIT_S, json={
            "model": MODEL, "prompt": f"# {i}\n" + PROMPTS[1], "max_tokens": 300, "temperature": 0}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r in results if r.status_code == 429]
    assert refused and all(r.headers.get("retry-after") for r in refused)
    assert refused[0].json()["error"]["type"] == "rate_limit_error"
    assert any(r.status_code == 200 for r in results)


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error(url):
    owners = sessions_by_replica(url, 4)
    session, victim = next(iter(owners.items()))
    events = []
    with httpx.stream("POST", url + "/v1/completions", headers={"x-session-id": session}, timeout=WAIT_S,
                      json={"model": MODEL, "prompt": "def g(x):\n", "max_tokens": 480, "temperature": 0,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                name = next(n for n in ray.util.list_named_actors(all_namespaces=True)
                            if victim in (n["name"] if isinstance(n, dict) else n))
                ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]), no_restart=False)
    assert "error" in json.loads(events[-1]) and events[-1] != "[DONE]"
    # Serve replaces the replica: requests spread over 2 replicas again, and /health counts both.
    deadline, serving = time.time() + REPLACE_S, set()
    while time.time() < deadline and len(serving) < 2:
        time.sleep(0.5)
        try:
            serving = set(sessions_by_replica(url, 8).values())
        except (AssertionError, httpx.HTTPError):  # a request the dead replica still took: try again
            serving = set()
    assert len(serving) == 2 and httpx.get(url + "/health").json()["roles"][MODEL]["replicas_ready"] == "2/2"
