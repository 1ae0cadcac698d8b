"""A fake Hugging Face hub: the routes `snapshot_download` uses, over repositories of local files."""

from __future__ import annotations

import hashlib
from pathlib import Path

FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub(repositories: dict[str, dict[str, Path]]):
    """The routes `snapshot_download` uses: model info, file tree, and file download."""
    from flask import Flask, abort, jsonify, send_file

    app = Flask("fake-hub")

    def files_of(repo_id: str) -> dict[str, Path]:
        if repo_id not in repositories:
            abort(404, description="Repository not found")
        return repositories[repo_id]

    @app.after_request
    def mark_missing_repositories(response):
        if response.status_code == 404:
            response.headers["X-Error-Code"] = "RepoNotFound"
        return response

    @app.get("/api/models/<org>/<name>/revision/<revision>")
    def model_info(org: str, name: str, revision: str):
        files = files_of(f"{org}/{name}")
        return jsonify(id=f"{org}/{name}", sha=FAKE_COMMIT, siblings=[{"rfilename": file} for file in files])

    @app.get("/api/models/<org>/<name>/tree/<revision>")
    def file_tree(org: str, name: str, revision: str):
        return jsonify(
            [
                {
                    "type": "file",
                    "path": file,
                    "size": path.stat().st_size,
                    "oid": hashlib.sha1(path.read_bytes()).hexdigest(),
                }
                for file, path in files_of(f"{org}/{name}").items()
            ]
        )

    @app.route("/<org>/<name>/resolve/<revision>/<path:file>", methods=["GET", "HEAD"])
    def resolve(org: str, name: str, revision: str, file: str):
        path = files_of(f"{org}/{name}").get(file) or abort(404)
        response = send_file(path, etag=False)
        response.headers["ETag"] = f'"{hashlib.sha256(path.read_bytes()).hexdigest()}"'
        response.headers["X-Repo-Commit"] = FAKE_COMMIT
        return response

    return app
