"""Which requests the server answers (by their Host and API key) and which pages may read its
answers (by their Origin).

A web page can make a browser send requests to 127.0.0.1 under a name of its own whose DNS record
it points there (DNS rebinding); the browser then treats the server as the page's own origin. A
Host check refuses such names, and CORS headers go only to the origins the user allows: on the API
those named with `--cors-origin`; on the model files and the app config also the pages of this
machine (`http://localhost:5173`, the harness itself), so a local WebLLM app needs no flag.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from flask import Response, request

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")
DEFAULT_PORTS = {"http": "80", "https": "443"}
CORS_PREFLIGHT_HEADERS = {"Access-Control-Allow-Methods": "GET, POST, OPTIONS", "Access-Control-Max-Age": "600"}


def split_host(host: str) -> tuple[str, str]:
    """A Host header's (name, port); the port is "" when absent."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, rest.removeprefix(":")
    name, _, port = host.partition(":")
    return name, port


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(name: str) -> bool:
    return name == "localhost" or (is_ip_literal(name) and ipaddress.ip_address(name).is_loopback)


# Each rule: (the Host's name, the address the server is bound to) -> whether the name is that server.
# A DNS rebinding attack needs a name of the attacker's; an address written as an IP cannot be rebound.
HOST_RULES = (
    lambda name, bound: name == bound,
    lambda name, bound: is_loopback(bound) and name in LOOPBACK_NAMES,
    lambda name, bound: bound in WILDCARD_ADDRESSES and is_ip_literal(name),
)


def host_allowed(host: str, environ: dict, allowed_names: tuple[str, ...]) -> bool:
    """Whether a request's Host names this server: the address it is bound to (its loopback
    aliases when that is loopback, any IP when it listens on all) with its port, or an allowed
    name with any port (the server may sit behind a proxy)."""
    name, port = split_host(host.lower())
    if name in allowed_names:
        return True
    if (port or DEFAULT_PORTS.get(environ.get("wsgi.url_scheme"), "")) != environ.get("SERVER_PORT"):
        return False
    bound = environ.get("SERVER_NAME", "").lower()
    return any(rule(name, bound) for rule in HOST_RULES)


def is_loopback_origin(origin: str) -> bool:
    """Whether a page origin is one of this machine's: http(s) on localhost, 127.0.0.0/8 or [::1], any port."""
    try:
        parts = urlsplit(origin)
    except ValueError:  # an unclosed [ of an IPv6 address
        return False
    return parts.scheme in ("http", "https") and is_loopback(parts.hostname or "")


def allow_cors(response: Response, origins: tuple[str, ...], loopback_pages: bool = False) -> None:
    """Echo an allowed page origin (and answer a preflight): one of `origins` ("*": any), or with
    `loopback_pages` any page of this machine."""
    origin = request.headers.get("Origin")
    response.vary.add("Origin")
    if origin is None or not ("*" in origins or origin in origins or (loopback_pages and is_loopback_origin(origin))):
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    if request.method == "OPTIONS":
        response.headers.update(CORS_PREFLIGHT_HEADERS)
        response.headers["Access-Control-Allow-Headers"] = request.headers.get(
            "Access-Control-Request-Headers", "Authorization, Content-Type"
        )


def bearer_token_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header is `Bearer <api_key>`, compared in constant time."""
    scheme, _, token = (authorization or "").partition(" ")
    # The header arrives decoded as latin-1; a key is printable ASCII (checked when the server starts).
    given = token.strip().encode("latin-1", errors="replace")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, api_key.encode())
