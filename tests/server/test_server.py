"""`kiln serve`: artifact hosting (MIME types, Range, ETag, WebLLM URLs, no path traversal), the
app config, and the OpenAI-compatible API over the native engine on the tiny Llama."""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from helpers.paths import WEB_DIR
from helpers.web import served

MODEL_ID = "tiny-llama-q4f32_1"
SECRET = b"KILN-SECRET-3141592653"
KILN = str(Path(sys.executable).with_name("kiln"))
QUESTION = [{"role": "user", "content": "Tell me about the history of the city"}]
ALLOWED_ORIGIN = "http://page.example"
ALLOWED_HOST = "kiln.example"


def raw_get(base: str, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as written (no client-side normalisation of `..` or `%2e`)."""
    parts = urlsplit(base)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.putrequest("GET", path, skip_accept_encoding=True)
    connection.endheaders()
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response.status, body


# Artifacts


def test_app_config_lists_the_browser_builds(url, tiny_dir):
    config = requests.get(f"{url}api/app-config.json").json()
    (record,) = [r for r in config["model_list"] if r["model_id"] == MODEL_ID]
    assert record["model"] == f"{url}models/{MODEL_ID}/"
    assert record["model_lib"] == f"{url}models/{MODEL_ID}/libs/{MODEL_ID}-webgpu.wasm"
    assert record["kiln"]["libraries"] == {
        t: f"{url}models/{MODEL_ID}/libs/{MODEL_ID}-{t}.wasm" for t in ("webgpu", "webgpu-subgroups", "wasm")
    }
    assert record["required_features"] == []  # f32: no shader-f16 needed
    weights = sum(s["nbytes"] for s in json.loads((tiny_dir / "tensor-cache.json").read_text())["records"])
    assert record["vram_required_MB"] * 2**20 > weights
    assert isinstance(record["buffer_size_required_bytes"], int) and record["buffer_size_required_bytes"] > 0
    assert record["low_resource_required"] is True
    assert record["overrides"]["context_window_size"] == 512


def test_a_model_with_only_the_subgroup_library_requires_subgroups(tiny_dir):
    from dataclasses import replace

    from kiln.app_config import model_record, read_compiled_model

    model = read_compiled_model(tiny_dir)
    targets = {name: entry for name, entry in model.build["targets"].items() if name != "webgpu"}
    record = model_record(replace(model, build={**model.build, "targets": targets}), "http://kiln.test/")
    assert record["model_lib"].endswith("-webgpu-subgroups.wasm")  # what WebLLM loads
    assert record["required_features"] == ["subgroups"]


def test_model_files_have_mime_types_ranges_and_etags(url, tiny_dir):
    library = tiny_dir / "libs" / f"{MODEL_ID}-webgpu.wasm"
    plain = requests.get(f"{url}models/{MODEL_ID}/libs/{library.name}")
    assert plain.status_code == 200
    assert plain.headers["Content-Type"] == "application/wasm"
    assert plain.content == library.read_bytes()
    assert plain.headers["Cache-Control"] == "no-cache"
    etag = plain.headers["ETag"]

    webllm_shape = requests.get(f"{url}models/{MODEL_ID}/resolve/main/libs/{library.name}")
    assert webllm_shape.content == plain.content

    partial = requests.get(f"{url}models/{MODEL_ID}/params_shard_0.bin", headers={"Range": "bytes=100-199"})
    assert partial.status_code == 206
    assert partial.content == (tiny_dir / "params_shard_0.bin").read_bytes()[100:200]
    assert partial.headers["Content-Range"].startswith("bytes 100-199/")

    unchanged = requests.get(f"{url}models/{MODEL_ID}/libs/{library.name}", headers={"If-None-Match": etag})
    assert unchanged.status_code == 304 and unchanged.content == b""

    page = {"Origin": "http://localhost:5173"}  # a page served from this machine
    chat_config = requests.get(f"{url}models/{MODEL_ID}/resolve/main/mlc-chat-config.json", headers=page)
    assert chat_config.headers["Content-Type"] == "application/json"
    assert chat_config.headers["Access-Control-Allow-Origin"] == page["Origin"]


def test_harness_and_engine_modules_are_served(url):
    page = requests.get(url)
    assert page.status_code == 200 and "text/html" in page.headers["Content-Type"]
    for path in (
        "web/harness/harness.js",
        "web/src/engine.js",
        "web/src/worker.js",
        "web/node_modules/@mlc-ai/web-runtime/lib/index.js",
        "web/node_modules/@mlc-ai/web-tokenizers/lib/index.js",
        "web/node_modules/@huggingface/jinja/dist/index.js",
        "web/src/tools.js",
        "web/src/chat-template.js",
    ):
        response = requests.get(url + path)
        assert response.status_code == 200, path
        assert response.headers["Content-Type"].startswith("text/javascript"), path
    # node_modules holds more than the page needs; only the packages it imports are served.
    assert requests.get(f"{url}web/node_modules/webgpu/package.json").status_code == 404
    assert requests.get(f"{url}web/node_modules/@huggingface/jinja/package.json").status_code == 404
    assert requests.get(f"{url}web/package.json").status_code == 404


@pytest.fixture
def traversal_dist(tmp_path, tiny_dir) -> tuple[Path, Path]:
    """A dist and a web folder whose model folder and harness hold symlinks to a secret outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    dist = tmp_path / "dist"
    model = dist / MODEL_ID
    model.mkdir(parents=True)
    for name in ("kiln-build.json", "mlc-chat-config.json", "tensor-cache.json"):
        shutil.copy(tiny_dir / name, model / name)
    (model / "leak.txt").symlink_to(outside / "secret.txt")
    (model / "leakdir").symlink_to(outside)
    (model / "inside.json").symlink_to(model / "mlc-chat-config.json")
    # /models/ serves the files the build record lists: inside.json is one of them.
    record = json.loads((model / "kiln-build.json").read_text())
    record["files"]["inside.json"] = record["files"]["mlc-chat-config.json"]
    (model / "kiln-build.json").write_text(json.dumps(record))
    (dist / ".kiln-build-staging").mkdir()
    (dist / ".kiln-build-staging" / "secret.txt").write_bytes(SECRET)
    web = tmp_path / "web"
    shutil.copytree(WEB_DIR / "harness", web / "harness")
    (web / "harness" / "leak.txt").symlink_to(outside / "secret.txt")
    return dist, web


def test_path_traversal_never_reads_outside_the_served_roots(traversal_dist):
    dist, web = traversal_dist
    secret = str(dist.parent / "outside" / "secret.txt")
    corpus = [
        f"/models/{MODEL_ID}/../../outside/secret.txt",
        f"/models/{MODEL_ID}/%2e%2e/%2e%2e/outside/secret.txt",
        f"/models/{MODEL_ID}/%2E%2E%2F%2E%2E%2Foutside%2Fsecret.txt",
        f"/models/{MODEL_ID}/..%2f..%2foutside/secret.txt",
        f"/models/{MODEL_ID}/resolve/main/../../../outside/secret.txt",
        f"/models/{MODEL_ID}/resolve/main/%2e%2e/%2e%2e/%2e%2e/outside/secret.txt",
        "/models/%2e%2e/outside/secret.txt",
        "/models/..%2f..%2f/outside/secret.txt",
        f"/models/{MODEL_ID}/{secret}",
        f"/models/{MODEL_ID}//{secret.lstrip('/')}",
        f"/models/{MODEL_ID}/%2f{secret.lstrip('/').replace('/', '%2f')}",
        f"/models/{MODEL_ID}/..\\..\\outside\\secret.txt",
        f"/models/{MODEL_ID}/leak.txt",
        f"/models/{MODEL_ID}/leakdir/secret.txt",
        f"/models/{MODEL_ID}/resolve/main/leak.txt",
        "/models/.kiln-build-staging/secret.txt",
        f"/models/{MODEL_ID}/mlc-chat-config.json%00.txt",
        "/web/harness/leak.txt",
        "/web/harness/../../outside/secret.txt",
        "/web/harness/%2e%2e/%2e%2e/outside/secret.txt",
        "/web/%2e%2e/outside/secret.txt",
        f"/web/{secret}",
        "/../outside/secret.txt",
        "/%2e%2e/outside/secret.txt",
        "/etc/passwd",
        "/models/../../../../../../etc/passwd",
        "/web/src/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    ]
    with served(dist, web_dir=web) as base:
        for path in corpus:
            status, body = raw_get(base, path)
            assert status in (400, 404), f"{path} → {status}"
            assert SECRET not in body and b"root:" not in body, path
        # A symlink that stays inside the root is an ordinary file.
        status, body = raw_get(base, f"/models/{MODEL_ID}/inside.json")
        assert status == 200 and body == (dist / MODEL_ID / "mlc-chat-config.json").read_bytes()


# OpenAI API


@pytest.mark.parametrize(
    "body, status, param",
    [
        ("not json", 400, None),
        ([1, 2], 400, None),
        ({"messages": QUESTION}, 400, "model"),
        ({"model": MODEL_ID}, 400, "messages"),
        ({"model": MODEL_ID, "messages": []}, 400, "messages"),
        ({"model": MODEL_ID, "messages": "hello"}, 400, "messages"),
        ({"model": MODEL_ID, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ({"model": MODEL_ID, "messages": [{"role": "user", "content": 42}]}, 400, "messages[0].content"),
        ({"model": MODEL_ID, "messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL_ID, "messages": QUESTION, "temperature": 7}, 400, "temperature"),
        ({"model": MODEL_ID, "messages": QUESTION, "top_p": 0}, 400, "top_p"),
        ({"model": MODEL_ID, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL_ID, "messages": QUESTION, "max_tokens": True}, 400, "max_tokens"),
        ({"model": MODEL_ID, "messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": MODEL_ID, "messages": QUESTION, "n": 2}, 400, "n"),
        ({"model": MODEL_ID, "messages": QUESTION, "stream": "yes"}, 400, "stream"),
        ({"model": "no-such-model", "messages": QUESTION}, 404, "model"),
        ({"model": MODEL_ID, "messages": QUESTION, "seed": -1}, 400, "seed"),
        ({"model": MODEL_ID, "messages": QUESTION, "seed": 2**64}, 400, "seed"),
        ({"model": MODEL_ID, "messages": QUESTION, "seed": 1.5}, 400, "seed"),
        (f'{{"model": "{MODEL_ID}", "messages": {json.dumps(QUESTION)}, "temperature": NaN}}', 400, "temperature"),
        (f'{{"model": "{MODEL_ID}", "messages": {json.dumps(QUESTION)}, "top_p": Infinity}}', 400, "top_p"),
        (
            f'{{"model": "{MODEL_ID}", "messages": {json.dumps(QUESTION)}, "presence_penalty": 1e999}}',
            400,
            "presence_penalty",
        ),
        ({"model": MODEL_ID, "messages": QUESTION, "top_k": True}, 400, "top_k"),
        ({"model": MODEL_ID, "messages": QUESTION, "n": True}, 400, "n"),
        ({"model": MODEL_ID, "messages": QUESTION, "ignore_eos": 1}, 400, "ignore_eos"),
        ({"model": MODEL_ID, "messages": QUESTION, "speculative": "maybe"}, 400, "speculative"),
        ({"model": MODEL_ID, "messages": QUESTION, "stop": [1]}, 400, "stop"),
        ({"model": MODEL_ID, "messages": QUESTION, "stop": {"a": 1}}, 400, "stop"),
        ({"model": MODEL_ID, "messages": QUESTION, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
        ({"model": MODEL_ID, "messages": QUESTION, "stream": True, "stream_options": []}, 400, "stream_options"),
        (
            {"model": MODEL_ID, "messages": QUESTION, "stream": True, "stream_options": {"include_usage": "yes"}},
            400,
            "stream_options.include_usage",
        ),
        ({"model": MODEL_ID, "messages": QUESTION, "logprobs": True}, 400, "logprobs"),
        ({"model": MODEL_ID, "messages": QUESTION, "logit_bias": {"5": 10}}, 400, "logit_bias"),
        (
            {"model": MODEL_ID, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            400,
            "messages[0].content",
        ),
        (
            {"model": MODEL_ID, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content",
        ),
        ({"model": MODEL_ID, "messages": [{"role": ["user"], "content": "x"}]}, 400, "messages[0].role"),
        ({"model": MODEL_ID, "messages": ["hello"]}, 400, "messages[0].role"),
        ({"model": MODEL_ID, "messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages[0].content"),
        ({"model": 7, "messages": QUESTION}, 400, "model"),
        ("[" * 100_000, 400, None),
    ],
)
def test_malformed_chat_requests_get_json_errors(url, body, status, param):
    data = body if isinstance(body, str) else json.dumps(body)
    response = requests.post(f"{url}v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_a_model_without_a_chat_template_completes_but_does_not_chat(tiny_build, tmp_path):
    source = tiny_build("q0f32")
    model_dir = tmp_path / "dist" / source.name
    shutil.copytree(source, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with served(model_dir.parent) as base:
        chat = requests.post(f"{base}v1/chat/completions", json={"model": source.name, "messages": QUESTION})
        completion = requests.post(
            f"{base}v1/completions", json={"model": source.name, "prompt": "The river", "max_tokens": 2}
        )
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert "no chat template" in error["message"] and "/v1/completions" in error["message"]
    assert (error["param"], error["code"]) == ("model", "model_cannot_chat")
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2


def test_oversized_and_misrouted_api_requests_get_json_errors(url):
    huge = {"model": MODEL_ID, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    too_large = requests.post(f"{url}v1/chat/completions", json=huge)
    assert too_large.status_code == 413 and "error" in too_large.json()
    wrong_method = requests.get(f"{url}v1/chat/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert requests.get(f"{url}v1/nothing").json()["error"]["message"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def kiln_serve(tiny_dir):
    """`kiln serve` itself, as a user starts it."""
    port = free_port()
    process = subprocess.Popen(
        [
            KILN,
            "serve",
            "--dist",
            str(tiny_dir.parent),
            "--port",
            str(port),
            "--cors-origin",
            ALLOWED_ORIGIN,
            "--cors-origin",
            "http://other.example",
            "--allow-host",
            ALLOWED_HOST,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(f"{base}health", timeout=2).json()["status"] == "ok":
                break
        except requests.ConnectionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"kiln serve did not start:\n{process.stdout.read()}")
        time.sleep(0.2)
    yield base
    process.terminate()
    process.wait(timeout=30)


def test_openai_client_streams_a_chat_completion(kiln_serve):
    from openai import OpenAI

    client = OpenAI(base_url=f"{kiln_serve}v1", api_key="not-needed")
    assert MODEL_ID in [m.id for m in client.models.list().data]
    request = {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 2, "the reply should arrive in several pieces"
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    assert chunks[-1].usage.completion_tokens >= len(content)
    whole = client.chat.completions.create(**request)
    assert whole.choices[0].message.content == "".join(content)
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    speculative = client.chat.completions.create(**request, extra_body={"speculative": "prompt-lookup"})
    assert speculative.choices[0].message.content == whole.choices[0].message.content


def test_openai_client_completes_a_prompt(kiln_serve):
    from openai import OpenAI

    client = OpenAI(base_url=f"{kiln_serve}v1", api_key="not-needed")
    streamed = list(
        client.completions.create(model=MODEL_ID, prompt="The history of", max_tokens=8, temperature=0, stream=True)
    )
    whole = client.completions.create(model=MODEL_ID, prompt="The history of", max_tokens=8, temperature=0)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.usage.completion_tokens == 8 or whole.choices[0].finish_reason == "stop"


def test_requests_for_one_model_wait_for_each_other(url):
    body = {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 48, "temperature": 0}
    results = []

    def ask():
        results.append(requests.post(f"{url}v1/chat/completions", json=body, timeout=300))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # The engine refuses a second generation while one runs: all three succeeding means they queued.
    assert [r.status_code for r in results] == [200, 200, 200]
    assert len({r.json()["choices"][0]["message"]["content"] for r in results}) == 1


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A connection that has sent a POST of `body` to `path` and reads nothing yet."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    client = socket.create_connection((parts.hostname, parts.port), timeout=60)
    client.sendall(
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), parts.netloc.encode(), len(data), data)
    )
    return client


def went_away_records(caplog, deadline_s: float = 30) -> list[logging.LogRecord]:
    """The server's "client went away" log records, waiting for the first (it is written just
    after the model is released)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        records = [r for r in caplog.records if "went away" in r.getMessage()]
        if records:
            return records
        time.sleep(0.05)
    return []


def test_a_client_that_disconnects_stops_its_generation(url, caplog):
    caplog.set_level(logging.INFO, logger="kiln.server.openai_api")
    body = {
        "model": MODEL_ID,
        "prompt": "The history of",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with raw_post(url, "/v1/completions", body) as client:
        received = b""
        while b"data:" not in received:
            received += client.recv(4096)
        assert received.startswith(b"HTTP/1.1 200")
    # The model is taken until the server notices; then a new request gets it at once.
    follow_up = requests.post(
        f"{url}v1/completions", timeout=300, json={"model": MODEL_ID, "prompt": "The history of", "max_tokens": 1}
    )
    assert follow_up.status_code == 200
    (stopped,) = went_away_records(caplog)
    assert stopped.args[0] < 400, "the generation ran to its end although nobody was reading"


def test_a_client_that_disconnects_stops_its_non_streamed_generation(url, caplog):
    caplog.set_level(logging.INFO, logger="kiln.server.openai_api")
    body = {"model": MODEL_ID, "prompt": "The history of", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    raw_post(url, "/v1/completions", body).close()  # gone before any reply
    follow_up = requests.post(
        f"{url}v1/completions", timeout=300, json={"model": MODEL_ID, "prompt": "The history of", "max_tokens": 1}
    )
    assert follow_up.status_code == 200
    records = went_away_records(caplog)
    assert records, "the generation ran to its end although nobody was waiting"
    assert records[0].args[0] < 400


def test_max_tokens_defaults_to_512_and_stops_at_the_context_window(url):
    from kiln.server.api_request import DEFAULT_MAX_TOKENS, ApiRequest

    asked = ApiRequest(MODEL_ID, stream=False, include_usage=False, sampling={})
    config = asked.generation_config({"temperature": 0.5})
    assert (config.max_tokens, config.temperature) == (DEFAULT_MAX_TOKENS, 0.5) == (512, 0.5)
    # The tiny model's window is 512 tokens: a reply without max_tokens ends where the window does.
    reply = requests.post(
        f"{url}v1/completions", timeout=300, json={"model": MODEL_ID, "prompt": "The history of", "ignore_eos": True}
    ).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    # The last token comes from the logits of the full window; it never enters it.
    assert reply["usage"]["total_tokens"] == 512 + 1


# Hosts and origins


def host_status(url: str, host: str, path: str = "/v1/models") -> requests.Response:
    return requests.get(url.rstrip("/") + path, headers={"Host": host}, timeout=30)


def test_requests_naming_another_host_are_refused(url):
    port = urlsplit(url).port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"LOCALHOST:{port}"):
        assert host_status(url, host).status_code == 200, host
    for host in (
        f"attacker.example:{port}",
        "attacker.example",
        f"127.0.0.1:{port + 1}",
        "127.0.0.1",
        f"localhost.attacker.example:{port}",
        f"10.0.0.1:{port}",
        "",
    ):
        api = host_status(url, host)
        assert api.status_code == 403, host
        assert "DNS rebinding" in api.json()["error"]["message"]
        for path in ("/", "/web/harness/harness.js", f"/models/{MODEL_ID}/mlc-chat-config.json"):
            page = host_status(url, host, path)
            assert page.status_code == 403 and SECRET not in page.content, (host, path)


def test_a_host_name_can_be_allowed(tiny_dir):
    with served(tiny_dir.parent, allowed_hosts=("Kiln.Test",)) as base:
        assert host_status(base, "kiln.test:8443").status_code == 200
        assert host_status(base, "kiln.test").status_code == 200
        assert host_status(base, "other.test").status_code == 403


def test_the_api_has_no_cors_by_default_and_model_files_only_for_pages_on_this_machine(url):
    origin = {"Origin": "http://page.example"}
    api = requests.get(f"{url}v1/models", headers=origin)
    assert api.status_code == 200 and "Access-Control-Allow-Origin" not in api.headers
    preflight = requests.options(
        f"{url}v1/chat/completions", headers={**origin, "Access-Control-Request-Method": "POST"}
    )
    assert "Access-Control-Allow-Origin" not in preflight.headers
    weights = requests.get(f"{url}models/{MODEL_ID}/tensor-cache.json", headers=origin)
    assert weights.status_code == 200 and "Access-Control-Allow-Origin" not in weights.headers
    loopback = {"Origin": "http://127.0.0.1:5173"}
    weights = requests.get(f"{url}models/{MODEL_ID}/tensor-cache.json", headers=loopback)
    assert weights.headers["Access-Control-Allow-Origin"] == loopback["Origin"]


def test_pages_and_workers_are_cross_origin_isolated_unless_turned_off(url, tiny_dir):
    isolation = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp"}
    paths = ("", "web/src/worker.js", "web/src/wasm-thread.js", f"models/{MODEL_ID}/tensor-cache.json", "v1/models")
    for path in paths:
        headers = requests.get(url + path).headers
        assert {name: headers.get(name) for name in isolation} == isolation, path
        assert headers["Cross-Origin-Resource-Policy"] == "cross-origin", path
    with served(tiny_dir.parent, cross_origin_isolation=False) as plain:
        for path in paths:
            headers = requests.get(plain + path).headers
            assert not set(isolation) & set(headers), path
            assert headers["Cross-Origin-Resource-Policy"] == "cross-origin", path


def test_allowed_origins_may_call_the_api(kiln_serve):
    allowed, other = {"Origin": ALLOWED_ORIGIN}, {"Origin": "http://elsewhere.example"}
    preflight = requests.options(
        f"{kiln_serve}v1/chat/completions",
        headers={
            **allowed,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert preflight.headers["Access-Control-Allow-Headers"] == "content-type,authorization"
    body = {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 2}
    reply = requests.post(f"{kiln_serve}v1/chat/completions", json=body, headers=allowed)
    assert reply.status_code == 200 and reply.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    assert "Origin" in reply.headers["Vary"]
    error = requests.post(f"{kiln_serve}v1/chat/completions", json={"model": MODEL_ID}, headers=allowed)
    assert error.status_code == 400 and error.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    refused = requests.post(f"{kiln_serve}v1/chat/completions", json=body, headers=other)
    assert "Access-Control-Allow-Origin" not in refused.headers
    assert requests.get(f"{kiln_serve}v1/models", headers={"Host": f"{ALLOWED_HOST}:1"}).status_code == 200


# Loading and releasing engines


@pytest.fixture(scope="module")
def two_models(tiny_dir, tiny_build) -> tuple[Path, str, str]:
    """A dist holding two models with a cpu library."""
    return tiny_dir.parent, MODEL_ID, tiny_build("q0f32").name


def test_loading_one_model_does_not_hold_up_another(two_models):
    from kiln.server.engines import NativeEngines

    dist, loaded_first, slow = two_models
    gate = threading.Event()

    class SlowLoading(NativeEngines):
        def load(self, model_id):
            if model_id == slow:
                gate.wait(120)
            return super().load(model_id)

    engines = SlowLoading(dist, "cpu", queue_timeout_s=60)
    ready = engines.lease(loaded_first).engine
    loading = threading.Thread(target=engines.lease, args=(slow,))
    loading.start()
    try:
        again = threading.Thread(target=engines.lease, args=(loaded_first,))
        again.start()
        again.join(timeout=60)
        assert not again.is_alive(), "a request to a loaded model waited for another model to load"
        assert loading.is_alive() and engines.loaded() == [loaded_first]
    finally:
        gate.set()
        loading.join()
    assert engines.loaded() == sorted([loaded_first, slow]) and engines.lease(loaded_first).engine is ready


def completion(client, model_id: str, **extra):
    return client.post(
        "/v1/completions",
        json={"model": model_id, "prompt": "The history of", "max_tokens": 2, "temperature": 0, **extra},
    )


def loaded(client) -> list[str]:
    return client.get("/health").json["engines_loaded"]


def test_past_the_budget_the_least_recently_used_idle_engine_is_released(two_models):
    from kiln.server import ServerConfig, create_app

    dist, first, second = two_models
    client = create_app(ServerConfig(dist=dist, max_loaded_models=1)).test_client()
    assert completion(client, first).status_code == 200 and loaded(client) == [first]
    assert completion(client, second).status_code == 200 and loaded(client) == [second]
    streaming = completion(client, first, stream=True, max_tokens=50, ignore_eos=True, buffered=False)
    chunks = iter(streaming.response)
    assert next(chunks).startswith(b"data:")  # generating, suspended until read
    assert completion(client, second).status_code == 200
    assert loaded(client) == sorted([first, second]), "an engine was released in the middle of a generation"
    streaming.close()
    assert completion(client, second).status_code == 200 and loaded(client) == [second]


def test_idle_engines_are_released(two_models):
    from kiln.server import ServerConfig, create_app

    dist, first, _ = two_models
    client = create_app(ServerConfig(dist=dist, idle_unload_s=1.0)).test_client()
    assert completion(client, first).status_code == 200 and loaded(client) == [first]
    deadline = time.monotonic() + 30
    while loaded(client) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loaded(client) == []
    assert completion(client, first).status_code == 200 and loaded(client) == [first]


@pytest.mark.parametrize(
    "bound, host, allowed",
    [
        ("127.0.0.1", "localhost:8000", True),
        ("127.0.0.1", "localhost:8001", False),
        ("::1", "[::1]:8000", True),
        ("::1", "127.0.0.1:8000", True),
        ("192.168.1.5", "192.168.1.5:8000", True),
        ("192.168.1.5", "localhost:8000", False),
        ("0.0.0.0", "192.168.1.5:8000", True),
        ("0.0.0.0", "[fe80::1]:8000", True),
        ("0.0.0.0", "rebound.example:8000", False),
        ("0.0.0.0", "localhost:8000", False),
    ],
)
def test_which_hosts_name_the_server(bound, host, allowed):
    from kiln.server.origins import host_allowed

    environ = {"SERVER_NAME": bound, "SERVER_PORT": "8000", "wsgi.url_scheme": "http"}
    assert host_allowed(host, environ, ()) is allowed
