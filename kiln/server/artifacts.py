"""The chat harness, the browser engine's files and the compiled models, plus the app config.

URL layout:
  /                                   the chat harness (web/harness/index.html)
  /web/<file>                         the harness and engine modules, the npm packages they import
                                      and, where web/ has its dev packages, @mlc-ai/web-llm
  /models/<model-id>/<file>           a file of a model folder under the dist folder that its
                                      build record lists (any other file there is a 404)
  /models/<model-id>/resolve/<rev>/<file>   the same, in the URL shape WebLLM builds
  /api/app-config.json                a WebLLM-style model list of the dist folder
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, abort, jsonify, request

from kiln.app_config import BUILD_RECORD, app_config, compiled_models, read_object
from kiln.errors import KilnError

from .files import resolve_inside, send_inside
from .web_files import WEB_PREFIXES

WEBLLM_PREFIX = "resolve/"
# Paths that pages of other origins may read, given CORS (app.py): the model files and the app config.
SHARED_PATHS = ("/models/", "/api/app-config.json")
# The harness page may run only this server's scripts and workers (WebAssembly included: the engine
# compiles the model library, and WebLLM pages compile theirs in the page itself), fetch only from
# it, show no frames and be framed by no page (clickjacking). It has no inline script or style; its
# one data: URL is the empty favicon.
HARNESS_CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self' 'wasm-unsafe-eval'",
        "worker-src 'self'",
        "connect-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)


def served_model_files(dist: Path, model_id: str) -> set[str]:
    """The build record and the files it lists. The record is served even when it lists none (or
    is malformed): the engine reads it first, and names what is wrong with it."""
    record_path = resolve_inside(dist, f"{model_id}/{BUILD_RECORD}")
    if record_path is None:
        return set()
    try:
        files = read_object(record_path).get("files")
    except KilnError:
        files = None
    return {BUILD_RECORD, *files} if isinstance(files, dict) else {BUILD_RECORD}


def make_artifacts_blueprint(config) -> Blueprint:
    artifacts = Blueprint("artifacts", __name__)

    @artifacts.get("/")
    def harness():
        response = send_inside(config.web_dir, "harness/index.html")
        response.headers["Content-Security-Policy"] = HARNESS_CSP
        return response

    @artifacts.get("/web/<path:relative>")
    def web_file(relative: str):
        if not relative.startswith(WEB_PREFIXES):
            abort(404)
        return send_inside(config.web_dir, relative)

    @artifacts.get("/models/<model_id>/<path:relative>")
    def model_file(model_id: str, relative: str):
        if relative.startswith(WEBLLM_PREFIX):
            _, _, relative = relative[len(WEBLLM_PREFIX) :].partition("/")
        # Only what the build made: never a file that came into the folder some other way.
        if relative not in served_model_files(config.dist, model_id):
            abort(404)
        return send_inside(config.dist, f"{model_id}/{relative}", cors=True)

    @artifacts.get("/api/app-config.json")
    def app_config_json():
        response = jsonify(app_config(compiled_models(config.dist), f"{request.host_url}models/"))
        response.headers["Cache-Control"] = "no-cache"
        return response

    return artifacts
