"""The chat harness, the browser engine's files and the compiled models, plus the app config.

URL layout:
  /                                   the chat harness (web/harness/index.html)
  /web/<file>                         the harness and engine modules, the npm packages they import
                                      and, where web/ has its dev packages, @mlc-ai/web-llm
  /models/<model-id>/<file>           a model folder under the dist folder
  /models/<model-id>/resolve/<rev>/<file>   the same, in the URL shape WebLLM builds
  /api/app-config.json                a WebLLM-style model list of the dist folder
"""

from __future__ import annotations

from flask import Blueprint, abort, jsonify, request

from kiln.app_config import app_config, compiled_models

from .files import CORS_HEADERS, send_inside

# The only parts of web/ the page loads; node_modules holds much else that is not for serving.
WEB_PREFIXES = (
    "src/",
    "harness/",
    "node_modules/@mlc-ai/web-runtime/lib/",
    "node_modules/@mlc-ai/web-tokenizers/lib/",
    "node_modules/@mlc-ai/web-xgrammar/lib/",
    "node_modules/@huggingface/jinja/dist/",
    "node_modules/@mlc-ai/web-llm/lib/",
)
WEBLLM_PREFIX = "resolve/"


def make_artifacts_blueprint(config) -> Blueprint:
    artifacts = Blueprint("artifacts", __name__)

    @artifacts.get("/")
    def harness():
        return send_inside(config.web_dir, "harness/index.html")

    @artifacts.get("/web/<path:relative>")
    def web_file(relative: str):
        if not relative.startswith(WEB_PREFIXES):
            abort(404)
        return send_inside(config.web_dir, relative)

    @artifacts.get("/models/<model_id>/<path:relative>")
    def model_file(model_id: str, relative: str):
        if relative.startswith(WEBLLM_PREFIX):
            _, _, relative = relative[len(WEBLLM_PREFIX) :].partition("/")
        return send_inside(config.dist, f"{model_id}/{relative}", cors=True)

    @artifacts.get("/api/app-config.json")
    def app_config_json():
        response = jsonify(app_config(compiled_models(config.dist), f"{request.host_url}models/"))
        response.headers.update(CORS_HEADERS)
        response.headers["Cache-Control"] = "no-cache"
        return response

    return artifacts
