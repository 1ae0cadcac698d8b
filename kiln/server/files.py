"""Serving files from a root folder: never a byte from outside it.

A request path is accepted only as plain segments (no `..`, `.`, empty or hidden segments, no
backslashes or NUL), and the file it names must still lie inside the root after symlinks are
resolved. Werkzeug has already percent-decoded the path, so `%2e%2e` arrives here as `..`.
"""

from __future__ import annotations

from pathlib import Path

from flask import Response, abort, send_file

MIME_TYPES = {
    ".wasm": "application/wasm",
    ".js": "text/javascript",
    ".mjs": "text/javascript",
    ".json": "application/json",
    ".map": "application/json",
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
# What a page of another origin allowed by CORS (see origins.py) may read of a model file's headers.
EXPOSED_HEADERS = {"Access-Control-Expose-Headers": "Content-Length, Content-Range, Accept-Ranges, ETag"}


def resolve_inside(root: Path, relative: str) -> Path | None:
    """The regular file `relative` names inside `root`, or None."""
    if not relative or "\x00" in relative or "\\" in relative or relative.startswith("/"):
        return None
    if any(part == "" or part.startswith(".") for part in relative.split("/")):
        return None
    real_root = root.resolve()
    candidate = (real_root / relative).resolve()
    if not candidate.is_relative_to(real_root) or not candidate.is_file():
        return None
    return candidate


def mime_type(path: Path) -> str:
    return MIME_TYPES.get(path.suffix.lower(), "application/octet-stream")


def send_inside(root: Path, relative: str, cors: bool = False) -> Response:
    """Send a file under `root` with its MIME type, ETag and Range support, or 404.

    `Cache-Control: no-cache` makes browsers revalidate (a 304 when the ETag still matches): model
    files keep their names across rebuilds, so they must never be served stale.
    """
    path = resolve_inside(root, relative)
    if path is None:
        abort(404)
    response = send_file(path, mimetype=mime_type(path), conditional=True, etag=True)
    if cors:
        response.headers.update(EXPOSED_HEADERS)
    return response
