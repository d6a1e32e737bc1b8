"""Who may call the server: holders of the API key, or, with no key, clients that name the
server's own address (a guard against DNS rebinding)."""
from __future__ import annotations

import hmac

from starlette.middleware import Middleware

from cllm.app import webui
from cllm.config import ApiKey, ServerConfig
from cllm.errors import APIError
from cllm.http.common import KEY_STATE, error_response, error_shape


def access_checks(config: ServerConfig) -> list[Middleware]:
    """Who may call the server: the API key's holders, or without a key, clients that name its
    address (scaleout/ray_app.py guards its own routes with these too)."""
    if config.keys():
        return [Middleware(APIKeyMiddleware, keys=config.keys(),
                           public_paths=frozenset({"/health"}) | webui.PUBLIC_PATHS)]
    if config.host not in WILDCARD_ADDRESSES:  # bound to all: any name may be legitimate
        return [Middleware(HostCheckMiddleware, bound_host=config.host)]
    return []


# Anthropic's routes, whose clients send their key as X-Api-Key.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but the public ones (/health, the chat
    page's files), compared in constant time; on Anthropic's routes `X-Api-Key: <key>` too, as
    Anthropic's clients send it. The matching key's entry goes to the request's state
    (`KEY_STATE`): whose request it is, for the fair shares."""

    def __init__(self, app, keys: tuple[ApiKey, ...], public_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = [(entry, b"Bearer " + entry.key.encode(), entry.key.encode())
                     for entry in keys]
        self.public_paths = public_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public_paths:
            headers = dict(scope["headers"])
            match = self._match(headers.get(b"authorization", b""),
                                headers.get(b"x-api-key") if scope["path"] in ANTHROPIC_PATHS
                                else None)
            if match is None:
                error = APIError(401, "missing or wrong API key", type="authentication_error",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(error, error_shape(scope["path"]))(scope, receive, send)
                return
            scope.setdefault("state", {})[KEY_STATE] = match
        await self.app(scope, receive, send)

    def _match(self, authorization: bytes, x_api_key: bytes | None) -> ApiKey | None:
        """The entry whose key was sent. Every key is compared, so the time taken does not
        tell how many keys there are before the right one."""
        match = None
        for entry, bearer, raw in self.keys:
            bearer_ok = hmac.compare_digest(authorization, bearer)
            key_ok = x_api_key is not None and hmac.compare_digest(x_api_key, raw)
            if bearer_ok or key_ok:
                match = entry
        return match


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::"})


class HostCheckMiddleware:
    """For a server with no API key: only requests whose Host names the bound address or a
    loopback name are served. Otherwise a web page could reach it by DNS rebinding: its own
    name, resolved to 127.0.0.1, arrives as the Host."""

    def __init__(self, app, bound_host: str) -> None:
        self.app = app
        self.allowed = LOOPBACK_NAMES | {_host_name(bound_host)}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and _host_name(
                dict(scope["headers"]).get(b"host", b"").decode("latin-1")) not in self.allowed:
            error = APIError(400, "the Host header names neither this server's address nor "
                             "localhost (set an API key to serve other names)", code="invalid_host")
            await error_response(error, error_shape(scope["path"]))(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """A Host header's (or a bound address's) name, lowercased, without the port: IPv6
    addresses in brackets."""
    host = host.lower()
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return f"[{host}]" if host.count(":") > 1 else host.partition(":")[0]
