"""`kiln serve` hardened (issue 37): an API key on /v1, a refusal to serve the network without one,
per-connection read timeouts, a bounded wait per model, engines leased until their request ends,
broken model folders skipped, CORS for the model files only for allowed and loopback pages, only
the build's own files served, no server path in a stream's error, a CSP on the harness.

The model folders here are what the server reads of a compiled model, without a compiled library:
nothing in this file runs a generation, so it needs no compiler."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
from flask import Response

from kiln.app_config import BUILD_RECORD
from kiln.cli import main
from kiln.compile.digests import file_digests
from kiln.engine import EngineBusy
from kiln.errors import KilnError
from kiln.server import ServerConfig, create_app
from kiln.server.app import check_exposure, make_kiln_server
from kiln.server.engines import ModelBusy, NativeEngines
from kiln.server.openai_api import answer, event_stream, started

KEY = "sk-kiln-test-3141592653"
GOOD, OTHER = "good-q4f32_1", "other-q4f32_1"
CHAT_CONFIG = {
    "quantization": "q4f32_1",
    "vocab_size": 256,
    "context_window_size": 512,
    "prefill_chunk_size": 64,
    "model_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "context_window_size": 512,
    },
}


def write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def make_model(dist: Path, model_id: str) -> Path:
    """A model folder as `kiln compile` lays it out (libraries as placeholder bytes), with its build record."""
    folder = dist / model_id
    libraries = {target: f"libs/{model_id}-{target}.{ext}" for target, ext in (("cpu", "so"), ("webgpu", "wasm"))}
    for library in libraries.values():
        (folder / library).parent.mkdir(parents=True, exist_ok=True)
        (folder / library).write_bytes(b"\0asm-placeholder")
    write_json(folder / "mlc-chat-config.json", CHAT_CONFIG)
    write_json(folder / "tensor-cache.json", {"records": [{"records": [{"name": "w", "nbytes": 4096}]}]})
    (folder / "params_shard_0.bin").write_bytes(bytes(4096))
    record = {
        "model_id": model_id,
        "source_hash": "ab" * 32,
        "targets": {target: {"library": path} for target, path in libraries.items()},
        "files": file_digests(folder),
    }
    write_json(folder / BUILD_RECORD, record)
    return folder


@pytest.fixture
def dist(tmp_path) -> Path:
    dist = tmp_path / "dist"
    make_model(dist, GOOD)
    return dist


def client_of(dist: Path, **config):
    return create_app(ServerConfig(dist=dist, **config)).test_client()


# The API key


def test_the_api_needs_its_key_and_preflights_do_not(dist):
    client = client_of(dist, api_key=KEY, cors_origins=("https://app.example",))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        refused = client.get("/v1/models", headers=headers)
        assert refused.status_code == 401, headers
        assert refused.headers["WWW-Authenticate"] == "Bearer"
        assert refused.json["error"]["code"] == "invalid_api_key" and refused.json["error"]["type"]
    assert client.post("/v1/chat/completions", json={"model": GOOD}).status_code == 401
    assert client.get("/v1/nothing").status_code == 401  # what exists is not told either
    for scheme in ("Bearer", "bearer"):
        allowed = client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert allowed.status_code == 200 and [m["id"] for m in allowed.json["data"]] == [GOOD]
    preflight = client.options(
        "/v1/chat/completions",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert preflight.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    # A page of an allowed origin can read the refusal, to tell its user.
    refused = client.get("/v1/models", headers={"Origin": "https://app.example"})
    assert refused.status_code == 401 and refused.headers["Access-Control-Allow-Origin"] == "https://app.example"
    # The harness and the model files are for the browser, which sends no key.
    assert client.get("/").status_code == 200
    assert client.get(f"/models/{GOOD}/mlc-chat-config.json").status_code == 200


def test_an_api_key_must_fit_in_a_header(dist):
    for key in ("", "two words", "kéy"):
        with pytest.raises(KilnError, match="printable ASCII"):
            create_app(ServerConfig(dist=dist, api_key=key))


def serve_in_thread(argv: list[str]) -> tuple[threading.Thread, list[int]]:
    """`kiln serve` in-process (in a thread, so a server that does start cannot hang the test)."""
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    thread.start()
    thread.join(timeout=10)
    return thread, codes


def test_serving_the_network_needs_a_key(dist, capsys, monkeypatch):
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        thread, codes = serve_in_thread(["serve", "--dist", str(dist), "--host", host, "--port", "0"])
        assert not thread.is_alive() and codes == [1], f"kiln serve --host {host} started without a key"
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("kiln: error: refusing to serve") and "--api-key" in line and "--no-api-key" in line
    # KILN_API_KEY is the key: a malformed one is refused as a key, not as a missing key.
    monkeypatch.setenv("KILN_API_KEY", "not a key")
    thread, codes = serve_in_thread(["serve", "--dist", str(dist), "--host", "0.0.0.0", "--port", "0"])
    assert codes == [1] and "printable ASCII" in capsys.readouterr().err
    check_exposure("0.0.0.0", ServerConfig(dist=dist), without_key=True)
    assert "WARNING" in capsys.readouterr().err
    for host in ("127.0.0.1", "localhost", "::1"):
        check_exposure(host, ServerConfig(dist=dist), without_key=False)
    check_exposure("0.0.0.0", ServerConfig(dist=dist, api_key=KEY), without_key=False)
    assert capsys.readouterr().err == ""


# Connections, queues, leases


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_idle_half_sent_connections_are_closed_and_their_threads_end(dist):
    server = make_kiln_server(ServerConfig(dist=dist, read_timeout_s=0.5), "127.0.0.1", 0)
    # A backlog for all of them: past werkzeug's 128 a connection would wait a second for a SYN retry.
    server.socket.listen(1024)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    port = server.server_port
    clients = []
    try:
        threads_before = threading.active_count()
        for _ in range(500):
            client = socket.create_connection(("127.0.0.1", port), timeout=10)
            client.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % port)  # never ends its headers
            clients.append(client)
        for client in clients:
            try:
                assert client.recv(1024) == b"", "the server answered a request it never received"
            except ConnectionResetError:
                pass
        # A connection's thread ends just after it closes the socket.
        assert wait_for(lambda: threading.active_count() <= threads_before)
    finally:
        for client in clients:
            client.close()
        server.shutdown()
        serving.join()


class StandIn:
    """What the pool reads of an engine: whether a generation holds it, and when one last ended."""

    busy = False

    def __init__(self):
        self.last_active = time.monotonic()


class CountingEngines(NativeEngines):
    """The pool, loading stand-ins and counting its loads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loads: Counter[str] = Counter()

    def load(self, model_id: str):
        self.loads[model_id] += 1
        return StandIn()


def test_an_engine_held_by_a_request_is_never_loaded_twice(dist):
    make_model(dist, OTHER)
    engines = CountingEngines(dist, "cpu", queue_timeout_s=1, max_loaded=1)
    first = engines.lease(GOOD)  # handed out, its generation not started yet
    engines.lease(OTHER).release()  # past the budget: the least recently used idle engine would go
    second = engines.lease(GOOD)
    assert engines.loads[GOOD] == 1 and second.engine is first.engine
    assert engines.loaded() == [GOOD]  # the idle one went instead
    first.release()
    second.release()
    engines.lease(OTHER).release()  # no longer held: the budget holds again
    assert engines.loaded() == [OTHER] and engines.loads == {GOOD: 1, OTHER: 2}


def fails(error: Exception):
    def raising(*args):
        raise error

    return raising


def test_a_full_queue_answers_503_with_retry_after(dist):
    engines = CountingEngines(dist, "cpu", queue_timeout_s=1, max_queue=2)
    held = [engines.lease(GOOD) for _ in range(3)]  # one generating, two waiting
    with pytest.raises(ModelBusy) as full:
        engines.lease(GOOD)
    held.pop().release()
    held.append(engines.lease(GOOD))
    # A request that waited its whole queue timeout gets the same answer.
    with pytest.raises(ModelBusy) as timed_out:
        started(fails(EngineBusy("the engine for good is busy with another generation")))
    with create_app(ServerConfig(dist=dist)).test_request_context():
        for error in (full.value, timed_out.value):
            response = error.response()
            assert response.status_code == 503 and int(response.headers["Retry-After"]) > 0
            assert response.json["error"]["code"] == "model_busy"
    for lease in held:
        lease.release()
    assert engines.slots[GOOD].leases == 0 and engines.loads[GOOD] == 1


def test_a_lease_ends_with_its_reply(dist):
    app = create_app(ServerConfig(dist=dist))
    engines = CountingEngines(dist, "cpu", queue_timeout_s=1)

    def slot_leases() -> int:
        return engines.slots[GOOD].leases

    with app.test_request_context():
        whole = answer(engines.lease(GOOD), lambda engine: app.response_class("{}"))
        assert not whole.is_streamed and slot_leases() == 0
        with pytest.raises(KilnError):
            answer(engines.lease(GOOD), fails(KilnError("the request cannot be answered")))
        assert slot_leases() == 0
        stream = answer(engines.lease(GOOD), lambda engine: Response(iter(["data: 1\n\n", "data: 2\n\n"])))
        events = iter(stream.response)
        assert next(events) == "data: 1\n\n" and slot_leases() == 1  # held while the stream runs
        assert list(events) == ["data: 2\n\n"] and slot_leases() == 0
        unread = answer(engines.lease(GOOD), lambda engine: Response(iter(["data: 1\n\n"])))
        unread.close()  # the server closes a stream nobody read
        assert slot_leases() == 0


# Broken folders, served files, origins


def test_a_broken_model_folder_is_skipped_and_the_others_answered(dist, caplog):
    broken = {
        "bad-json": ("mlc-chat-config.json", "{not json"),
        "a-list": (BUILD_RECORD, "[]"),
        "no-model-config": ("mlc-chat-config.json", json.dumps({"quantization": "q4f32_1"})),
        "bad-targets": (BUILD_RECORD, json.dumps({"targets": {"webgpu": "libs/x.wasm"}})),
        "bad-records": ("tensor-cache.json", json.dumps({"records": 7})),
    }
    for model_id, (name, text) in broken.items():
        (make_model(dist, model_id) / name).write_text(text)
    client = client_of(dist)
    caplog.set_level(logging.WARNING, logger="kiln.app_config")
    for _ in range(2):
        models = client.get("/v1/models")
        assert models.status_code == 200 and [m["id"] for m in models.json["data"]] == [GOOD]
        config = client.get("/api/app-config.json")
        assert config.status_code == 200 and [r["model_id"] for r in config.json["model_list"]] == [GOOD]
        health = client.get("/health")
        assert health.status_code == 200 and health.json["models"] == [GOOD]
    warned = [r.getMessage() for r in caplog.records if "broken model folder" in r.getMessage()]
    assert len(warned) == len(broken), "each broken folder is warned of once, however often it is read"
    assert all(any(model_id in message for message in warned) for model_id in broken)
    caplog.clear()
    (dist / "bad-json" / "mlc-chat-config.json").write_text("{still not json")
    client.get("/health")
    (again,) = [r.getMessage() for r in caplog.records]
    assert "bad-json" in again


def test_only_the_files_the_build_recorded_are_served(dist):
    folder = dist / GOOD
    (folder / "notes.txt").write_text("a file the build did not make")
    (folder / "libs" / "extra.wasm").write_bytes(b"\0asm")
    client = client_of(dist)
    for path in ("notes.txt", "libs/extra.wasm", "resolve/main/notes.txt", "resolve/main/libs/extra.wasm"):
        assert client.get(f"/models/{GOOD}/{path}").status_code == 404, path
    recorded = json.loads((folder / BUILD_RECORD).read_text())["files"]
    for path in [*recorded, BUILD_RECORD]:
        for url in (f"/models/{GOOD}/{path}", f"/models/{GOOD}/resolve/main/{path}"):
            served = client.get(url)
            assert served.status_code == 200 and served.data == (folder / path).read_bytes(), url
    # A record that lists no files serves itself alone (the engine names what is wrong with it).
    for record in ("{broken", json.dumps({"model_id": GOOD})):
        (folder / BUILD_RECORD).write_text(record)
        assert client.get(f"/models/{GOOD}/mlc-chat-config.json").status_code == 404
        assert client.get(f"/models/{GOOD}/resolve/main/{BUILD_RECORD}").data == record.encode()


def test_model_files_and_the_app_config_are_shared_with_allowed_and_loopback_pages_only(dist):
    client = client_of(dist, cors_origins=("https://app.example",))
    paths = (f"/models/{GOOD}/mlc-chat-config.json", f"/models/{GOOD}/resolve/main/tensor-cache.json")
    for path in (*paths, "/api/app-config.json"):
        for origin in ("https://elsewhere.example", "http://localhost.elsewhere.example", "null"):
            response = client.get(path, headers={"Origin": origin})
            assert response.status_code == 200 and "Access-Control-Allow-Origin" not in response.headers, origin
            assert "Origin" in response.headers["Vary"]
        for origin in ("https://app.example", "http://localhost:5173", "http://127.0.0.1:8000", "http://[::1]:8000"):
            response = client.get(path, headers={"Origin": origin})
            assert response.headers.get("Access-Control-Allow-Origin") == origin, (path, origin)
    assert (
        "ETag"
        in client.get(paths[0], headers={"Origin": "http://localhost:5173"}).headers["Access-Control-Expose-Headers"]
    )
    # The API stays closed to every page not named with --cors-origin, loopback ones included.
    api = client.get("/v1/models", headers={"Origin": "http://localhost:5173"})
    assert "Access-Control-Allow-Origin" not in api.headers


def test_a_failing_stream_does_not_tell_the_server_s_paths():
    secret_folder = "/srv/private/dist/good-q4f32_1"

    def chunks():
        raise KilnError("the model library failed in decode", secret_folder)
        yield

    engine = SimpleNamespace(tokens_generated=0)
    events = list(event_stream(chunks(), False, nullcontext(), engine))
    (error,) = [json.loads(e.removeprefix("data: "))["error"] for e in events if '"error"' in e]
    assert error["message"] == "the model library failed in decode"
    assert not any("/srv/private" in event for event in events)


def test_the_harness_has_a_content_security_policy(dist):
    client = client_of(dist)
    page = client.get("/")
    policy = dict(
        (directive.split(" ", 1) + [""])[:2] for directive in page.headers["Content-Security-Policy"].split("; ")
    )
    assert policy["frame-ancestors"] == "'none'" and policy["default-src"] == "'self'"
    assert policy["script-src"] == "'self' 'wasm-unsafe-eval'"  # no inline or eval'd script
    assert policy["connect-src"] == "'self'" and policy["worker-src"] == "'self'"
    for path in ("/", "/web/src/worker.js", f"/models/{GOOD}/mlc-chat-config.json", "/v1/models"):
        assert client.get(path).headers["X-Content-Type-Options"] == "nosniff", path
