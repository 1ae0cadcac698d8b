"""The Flask app factory and `kiln serve`."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from flask import Flask, Response, abort, jsonify, request
from werkzeug.exceptions import HTTPException
from werkzeug.serving import make_server

from kiln.app_config import compiled_models
from kiln.errors import KilnError

from .artifacts import make_artifacts_blueprint
from .api_request import ApiError
from .engines import NativeEngines
from .openai_api import make_openai_blueprint
from .origins import allow_cors, host_allowed
from .web_files import default_web_dir

NPM_PACKAGES = ("@mlc-ai/web-runtime", "@mlc-ai/web-tokenizers", "@mlc-ai/web-xgrammar", "@huggingface/jinja")
# Cross-origin isolation: what a page and its workers need for SharedArrayBuffer, so the CPU wasm
# library runs on several threads (web/src/wasm-threads.js). Isolation costs a page `window.opener`
# and needs CORS or CORP on every other-origin resource it loads; `kiln serve --no-isolation` drops it.
ISOLATION_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp"}
# Every response may be loaded by an isolated page on another origin (a WebLLM app, say).
CORP_HEADER = {"Cross-Origin-Resource-Policy": "cross-origin"}


@dataclass(frozen=True)
class ServerConfig:
    dist: Path  # a folder of compiled model folders
    web_dir: Path = field(default_factory=default_web_dir)
    native_target: str = "cpu"  # the library the OpenAI API runs
    max_request_bytes: int = 1 << 20
    queue_timeout_s: float = 600.0  # how long a request waits for its model to be free
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides the bound address
    cors_origins: tuple[str, ...] = ()  # page origins allowed to call /v1 ("*": any)
    idle_unload_s: float = 600.0  # release a model's engine unused this long (0: never)
    max_loaded_models: int = 2  # release the least recently used past this many (0: no limit)
    cross_origin_isolation: bool = True  # send COOP/COEP, so the harness's wasm runs on threads


def create_app(config: ServerConfig) -> Flask:
    if not config.dist.is_dir():
        raise KilnError("the dist folder to serve does not exist", config.dist)
    app = Flask(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes
    # A path with `//` is refused like any other odd path rather than redirected to a cleaned one.
    app.url_map.merge_slashes = False
    engines = NativeEngines(
        config.dist, config.native_target, config.queue_timeout_s, config.idle_unload_s, config.max_loaded_models
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

    @app.after_request
    def cross_origin_headers(response: Response) -> Response:
        if request.path.startswith("/v1/") and config.cors_origins:
            allow_cors(response, config.cors_origins)
        response.headers.update(CORP_HEADER)
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


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the server until interrupted (threaded: streams and downloads run side by side)."""
    app = create_app(config)
    missing = missing_npm_packages(config.web_dir)
    if missing:
        print(
            f"kiln: warning: the chat harness needs npm packages ({', '.join(missing)}): "
            f"run `npm ci` in {config.web_dir}",
            file=sys.stderr,
        )
    server = make_server(host, port, app, threaded=True)
    models = compiled_models(config.dist)
    print(
        f"kiln: serving {len(models)} model(s) from {config.dist} at http://{host}:{server.server_port}/",
        file=sys.stderr,
        flush=True,
    )
    server.serve_forever()
