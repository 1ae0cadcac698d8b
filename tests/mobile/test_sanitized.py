"""Bad input through the C API, in a host build of the runtime and a C app under AddressSanitizer:
every bad request and every broken model folder is an error code and a message, never a crash or a
memory error."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from helpers.mobile_app import ChatApp, build_chat_app

pytestmark = pytest.mark.slow

# Leaks are not checked: TVM's registries live as long as the process, by design.
SANITIZED = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0:exitcode=99"}
QUESTION = [{"role": "user", "content": "Tell me about the history of the city"}]
BAD_REQUESTS = [
    ("not json", "bad-request"),
    ("", "bad-request"),
    ("[1, 2]", "bad-request"),
    ("null", "bad-request"),
    ("[" * 5000 + "]" * 5000, "bad-request"),
    (json.dumps({"messages": "hi"}), "bad-request"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "bad-request"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}), "bad-request"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "bad-request"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]}), "bad-request"),
    (json.dumps({"messages": QUESTION, "max_tokens": -1}), "bad-request"),
    (json.dumps({"messages": QUESTION, "temperature": "hot"}), "bad-request"),
    (json.dumps({"messages": QUESTION, "top_k": 1.5}), "bad-request"),
    (json.dumps({"messages": QUESTION, "seed": -1}), "bad-request"),
    (json.dumps({"messages": QUESTION, "stop": [1]}), "bad-request"),
    (json.dumps({"messages": QUESTION, "n": 2}), "bad-request"),
    (json.dumps({"messages": QUESTION, "tools": []}), "bad-request"),
    (json.dumps({"messages": [{"role": "user", "content": "\U0001f600 " * 3000}]}), "context-window-exceeded"),
]


@pytest.fixture(scope="module")
def sanitized_app(tmp_path_factory):
    return build_chat_app("host-asan", tmp_path_factory.mktemp("asan"))


@pytest.fixture(scope="module")
def model(tiny_build):
    return tiny_build("q4f32_1", ["cpu"])


def close_cleanly(app: ChatApp) -> None:
    status = app.close()
    errors = app.process.stderr.read()
    assert status == 0 and "AddressSanitizer" not in errors, errors[-4000:]


def test_bad_requests_are_error_codes(sanitized_app, model):
    app = ChatApp(sanitized_app, qemu=False, env=SANITIZED)
    assert app.create({"model": str(model)}) is None
    for body, code in BAD_REQUESTS:
        reply = app.chat(body)
        assert reply.code == code, (body[:80], reply)
    reply = app.chat({"messages": QUESTION, "temperature": 0, "max_tokens": 8})
    assert reply.status == 0 and reply.finish_reason == "length", reply.message
    close_cleanly(app)


def broken_copies(model, tmp_path) -> list[tuple[str, str, str]]:
    """(folder, code, what the message says) for copies of `model`, each broken in one way."""
    cases = []

    def copy(name: str, change) -> None:
        folder = tmp_path / name
        shutil.copytree(model, folder)
        change(folder)
        cases.append(folder)

    def edit_json(name: str, edit):
        def change(folder):
            path = folder / name
            path.write_text(json.dumps(edit(json.loads(path.read_text()))))

        return change

    def first_record(index: dict, **fields) -> dict:
        index["records"][0]["records"][0].update(fields)
        return index

    shard = "params_shard_0.bin"
    changes = {
        "truncated-index": (lambda f: (f / "tensor-cache.json").write_text('{"records": ['), "bad-model", "malformed"),
        "offset-past-shard": (
            edit_json("tensor-cache.json", lambda index: first_record(index, byteOffset=1 << 40)),
            "bad-model",
            "does not fit its shard",
        ),
        "wrong-shape": (
            edit_json("tensor-cache.json", lambda index: first_record(index, shape=[1 << 20, 1 << 20])),
            "bad-model",
            "does not fit its shard",
        ),
        "flipped-byte": (
            lambda f: (f / shard).write_bytes(bytes([(f / shard).read_bytes()[0] ^ 1]) + (f / shard).read_bytes()[1:]),
            "integrity",
            "md5",
        ),
        "short-shard": (lambda f: (f / shard).write_bytes((f / shard).read_bytes()[:-7]), "integrity", "bytes"),
        "no-conv-template": (
            edit_json("mlc-chat-config.json", lambda config: {k: v for k, v in config.items() if k != "conv_template"}),
            "bad-model",
            "conv_template",
        ),
        "garbage-tokenizer": (lambda f: (f / "tokenizer.json").write_text("{]"), "bad-model", "tokenizer.json"),
        "garbage-build-record": (lambda f: (f / "kiln-build.json").write_text("\x00\x01"), "bad-model", "kiln-build"),
    }
    for name, (change, _, _) in changes.items():
        copy(name, change)
    return [(str(folder), code, said) for folder, (_, code, said) in zip(cases, changes.values())]


def test_broken_model_folders_are_error_codes(sanitized_app, model, tmp_path):
    app = ChatApp(sanitized_app, qemu=False, env=SANITIZED)
    for folder, code, said in [(str(tmp_path / "missing"), "bad-model", "missing"), *broken_copies(model, tmp_path)]:
        failure = app.create({"model": folder})
        assert failure is not None and failure.code == code, (folder, failure)
        assert said in failure.message, (folder, failure.message)
    for config in ("not json", json.dumps({"model": 5}), json.dumps({})):
        failure = app.create(config)
        assert failure is not None and failure.code == "bad-request", (config, failure)
    close_cleanly(app)
