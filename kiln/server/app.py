"""The Flask app factory and `kiln serve`."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from flask import Flask, Response, abort, jsonify, request
from werkzeug.exceptions import HTTPException
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

from kiln.app_config import compiled_models
from kiln.speculative import Speculation
from kiln.errors import KilnError

from .artifacts import SHARED_PATHS, make_artifacts_blueprint
from .api_request import ApiError
from .engines import NativeEngines
from .openai_api import make_openai_blueprint
from .origins import allow_cors, bearer_token_matches, host_allowed, is_loopback
from .web_files import default_web_dir

NPM_PACKAGES = ("@mlc-ai/web-runtime", "@mlc-ai/web-tokenizers", "@mlc-ai/web-xgrammar", "@huggingface/jinja")
# Cross-origin isolation: what a page and its workers need for SharedArrayBuffer, so the CPU wasm
# library runs on several threads (web/src/wasm-threads.js). Isolation costs a page `window.opener`
# and needs CORS or CORP on every other-origin resource it loads; `kiln serve --no-isolation` drops it.
ISOLATION_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp"}
# Every response may be loaded by an isolated page on another origin (a WebLLM app, say).
CORP_HEADER = {"Cross-Origin-Resource-Policy": "cross-origin"}
# A file is what its Content-Type says: a browser never runs a model's JSON as a script.
NOSNIFF_HEADER = {"X-Content-Type-Options": "nosniff"}
# A key travels in an HTTP header: printable ASCII without spaces.
API_KEY_CHARACTERS = frozenset(map(chr, range(0x21, 0x7F)))


@dataclass(frozen=True)
class ServerConfig:
    dist: Path  # a folder of compiled model folders
    web_dir: Path = field(default_factory=default_web_dir)
    native_target: str = "cpu"  # the library the OpenAI API runs
    max_request_bytes: int = 1 << 20
    queue_timeout_s: float = 600.0  # how long a request waits for its model to be free
    # How many requests may wait for a model while it generates. The default leaves room for the
    # load test's 32 clients on one model (and the requests of those that hung up, still waiting).
    max_queue: int = 64
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides the bound address
    cors_origins: tuple[str, ...] = ()  # page origins allowed to call /v1 and read the models ("*": any)
    idle_unload_s: float = 600.0  # release a model's engine unused this long (0: never)
    max_loaded_models: int = 2  # release the least recently used past this many (0: no limit)
    cross_origin_isolation: bool = True  # send COOP/COEP, so the harness's wasm runs on threads
    api_key: str | None = None  # required of /v1 requests as `Authorization: Bearer <key>`
    read_timeout_s: float = 30.0  # close a connection that sends nothing for this long
    speculation: Speculation | None = None  # how the native engines decode (kiln.speculative)


def check_config(config: ServerConfig) -> None:
    if not config.dist.is_dir():
        raise KilnError("the dist folder to serve does not exist", config.dist)
    if config.api_key is not None and not (config.api_key and set(config.api_key) <= API_KEY_CHARACTERS):
        raise KilnError("an API key must be printable ASCII without spaces")
    if config.max_queue < 0:
        raise KilnError(f"the queue bound must be 0 or more, not {config.max_queue}")


def create_app(config: ServerConfig) -> Flask:
    check_config(config)
    app = Flask(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes
    # A path with `//` is refused like any other odd path rather than redirected to a cleaned one.
    app.url_map.merge_slashes = False
    engines = NativeEngines(
        config.dist,
        config.native_target,
        config.queue_timeout_s,
        config.idle_unload_s,
        config.max_loaded_models,
        config.max_queue,
        config.speculation,
    )
    allowed_names = tuple(name.lower() for name in config.allowed_hosts)
    app.register_blueprint(make_artifacts_blueprint(config))
    app.register_blueprint(make_openai_blueprint(engines))

    @app.before_request
    def refuse_other_hosts():
        if not host_allowed(request.host, request.environ, allowed_names):
            abort(
                403,
                f"The Host {request.host!r} is not this server (DNS rebinding?): use its address, "
                "or allow the name with `kiln serve --allow-host NAME`.",
            )

    @app.before_request
    def require_the_api_key():
        # A preflight carries no credentials (browsers never send them on OPTIONS).
        if config.api_key is None or not request.path.startswith("/v1/") or request.method == "OPTIONS":
            return None
        if bearer_token_matches(request.headers.get("Authorization"), config.api_key):
            return None
        refused = ApiError(
            401,
            "Missing or incorrect API key: send `Authorization: Bearer <key>` with the key `kiln serve` was given.",
            code="invalid_api_key",
        ).response()
        refused.headers["WWW-Authenticate"] = "Bearer"
        return refused

    @app.after_request
    def cross_origin_headers(response: Response) -> Response:
        if request.path.startswith("/v1/") and config.cors_origins:
            allow_cors(response, config.cors_origins)
        elif request.path.startswith(SHARED_PATHS):
            allow_cors(response, config.cors_origins, loopback_pages=True)
        response.headers.update(CORP_HEADER)
        response.headers.update(NOSNIFF_HEADER)
        if config.cross_origin_isolation:
            response.headers.update(ISOLATION_HEADERS)
        return response

    @app.get("/health")
    def health():
        return jsonify(
            {
                "status": "ok",
                "models": [m.model_id for m in compiled_models(config.dist)],
                "engines_loaded": engines.loaded(),
            }
        )

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException):
        # API clients get JSON for every error (404, 405, 413, ...); pages get werkzeug's HTML.
        if request.path.startswith("/v1/"):
            return ApiError(error.code, error.description, error_type="invalid_request_error").response()
        if request.path.startswith("/api/") or request.path == "/health":
            response = jsonify({"error": {"message": error.description, "code": error.code}})
            response.status_code = error.code
            return response
        return error

    return app


def missing_npm_packages(web_dir: Path) -> list[str]:
    return [p for p in NPM_PACKAGES if not (web_dir / "node_modules" / p).is_dir()]


class TimedRequestHandler(WSGIRequestHandler):
    """Werkzeug's handler with a socket timeout, which socketserver sets on each accepted connection:
    one that sends nothing for `timeout` seconds (idle between requests, or halfway through one) is
    closed and its thread ends, so idle connections cannot pile up threads."""

    timeout = ServerConfig.read_timeout_s

    def log_error(self, format: str, *args) -> None:
        # A browser's idle keep-alive connection times out as a matter of course: not worth a line.
        if not format.startswith("Request timed out"):
            super().log_error(format, *args)


def make_kiln_server(config: ServerConfig, host: str, port: int) -> BaseWSGIServer:
    """The threaded HTTP server of `create_app(config)` on host:port (0: a free port), not yet serving."""
    handler = type("KilnRequestHandler", (TimedRequestHandler,), {"timeout": config.read_timeout_s})
    return make_server(host, port, create_app(config), threaded=True, request_handler=handler)


def check_exposure(host: str, config: ServerConfig, without_key: bool) -> None:
    """Refuse to serve the API to the network without a key, unless told to (then warn)."""
    if is_loopback(host) or config.api_key is not None:
        return
    if not without_key:
        raise KilnError(
            f"refusing to serve {host or 'all addresses'} without an API key: anyone on the network could "
            "use /v1; pass --api-key KEY (or set KILN_API_KEY), or --no-api-key to serve it to all"
        )
    print(
        f"kiln: WARNING: serving {host or 'all addresses'} WITHOUT an API key (--no-api-key): anyone who can "
        "reach this port can use /v1, load and unload models and download them",
        file=sys.stderr,
    )


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, without_key: bool = False) -> None:
    """Run the server until interrupted (threaded: streams and downloads run side by side). A host
    other than loopback needs `config.api_key`, or `without_key`."""
    check_exposure(host, config, without_key)
    server = make_kiln_server(config, host, port)
    missing = missing_npm_packages(config.web_dir)
    if missing:
        print(
            f"kiln: warning: the chat harness needs npm packages ({', '.join(missing)}): "
            f"run `npm ci` in {config.web_dir}",
            file=sys.stderr,
        )
    models = compiled_models(config.dist)
    print(
        f"kiln: serving {len(models)} model(s) from {config.dist} at http://{host}:{server.server_port}/",
        file=sys.stderr,
        flush=True,
    )
    server.serve_forever()
