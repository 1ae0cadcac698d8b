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

from web_helpers import WEB_DIR, served

MODEL_ID = "tiny-llama-q4f32_1"
SECRET = b"KILN-SECRET-3141592653"
KILN = str(Path(sys.executable).with_name("kiln"))
QUESTION = [{"role": "user", "content": "Tell me about the history of the city"}]


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
    assert record["kiln"]["libraries"] == {t: f"{url}models/{MODEL_ID}/libs/{MODEL_ID}-{t}.wasm" for t in ("webgpu", "wasm")}
    assert record["required_features"] == []  # f32: no shader-f16 needed
    weights = sum(s["nbytes"] for s in json.loads((tiny_dir / "tensor-cache.json").read_text())["records"])
    assert record["vram_required_MB"] * 2**20 > weights
    assert isinstance(record["buffer_size_required_bytes"], int) and record["buffer_size_required_bytes"] > 0
    assert record["low_resource_required"] is True
    assert record["overrides"]["context_window_size"] == 512


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

    chat_config = requests.get(f"{url}models/{MODEL_ID}/resolve/main/mlc-chat-config.json")
    assert chat_config.headers["Content-Type"] == "application/json"
    assert chat_config.headers["Access-Control-Allow-Origin"] == "*"


def test_harness_and_engine_modules_are_served(url):
    page = requests.get(url)
    assert page.status_code == 200 and "text/html" in page.headers["Content-Type"]
    for path in ("web/harness/harness.js", "web/src/engine.js", "web/src/worker.js",
                 "web/node_modules/@mlc-ai/web-runtime/lib/index.js",
                 "web/node_modules/@mlc-ai/web-tokenizers/lib/index.js"):
        response = requests.get(url + path)
        assert response.status_code == 200, path
        assert response.headers["Content-Type"].startswith("text/javascript"), path
    # node_modules holds more than the page needs; only the two runtime packages are served.
    assert requests.get(f"{url}web/node_modules/webgpu/package.json").status_code == 404
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
        f"/models/%2e%2e/outside/secret.txt",
        f"/models/..%2f..%2f/outside/secret.txt",
        f"/models/{MODEL_ID}/{secret}",
        f"/models/{MODEL_ID}//{secret.lstrip('/')}",
        f"/models/{MODEL_ID}/%2f{secret.lstrip('/').replace('/', '%2f')}",
        f"/models/{MODEL_ID}/..\\..\\outside\\secret.txt",
        f"/models/{MODEL_ID}/leak.txt",
        f"/models/{MODEL_ID}/leakdir/secret.txt",
        f"/models/{MODEL_ID}/resolve/main/leak.txt",
        f"/models/.kiln-build-staging/secret.txt",
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


@pytest.mark.parametrize("body, status, param", [
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
])
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
        completion = requests.post(f"{base}v1/completions",
                                   json={"model": source.name, "prompt": "The river", "max_tokens": 2})
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
    process = subprocess.Popen([KILN, "serve", "--dist", str(tiny_dir.parent), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


def test_openai_client_completes_a_prompt(kiln_serve):
    from openai import OpenAI

    client = OpenAI(base_url=f"{kiln_serve}v1", api_key="not-needed")
    streamed = list(client.completions.create(model=MODEL_ID, prompt="The history of", max_tokens=8, temperature=0,
                                              stream=True))
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


def test_a_client_that_disconnects_stops_its_generation(url, caplog):
    caplog.set_level(logging.INFO, logger="kiln.server.openai_api")
    body = json.dumps({"model": MODEL_ID, "prompt": "The history of", "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data:" not in received:
            received += client.recv(4096)
        assert received.startswith(b"HTTP/1.1 200")
    # The model is taken until the server notices; then a new request gets it at once.
    follow_up = requests.post(f"{url}v1/completions", timeout=300,
                              json={"model": MODEL_ID, "prompt": "The history of", "max_tokens": 1})
    assert follow_up.status_code == 200
    (stopped,) = [r for r in caplog.records if "went away" in r.getMessage()]
    assert stopped.args[0] < 400, "the generation ran to its end although nobody was reading"
