"""Scale-out on Ray Serve: one cllm engine per replica behind one endpoint.

Ray's HTTP proxy hands each request to `Front`, which reads the body, computes its routing
key (routing.route_key) and relays the request to an `Engine` replica through a deployment
handle; `PrefixRouter`, running in the handle, picks the replica. Each `Engine` replica runs
the single server's own Starlette app (server.create_app): the same routes, bodies, SSE streams
and errors. `Board` collects the replicas' metrics for the front's /metrics.
docs/design/scale-out.md has the design and why; README.md ("Scale-out") the commands."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response

from cllm.app.launch import app_for
from cllm.app.server import access_checks
from cllm.config import ServerConfig
from cllm.errors import APIError
from cllm.http import metrics
from cllm.http.common import error_response, error_shape, read_body
from cllm.http.registry import FAILED, LOADED
from cllm.http.responses import sse_event, typed_event
from cllm.protocols.openai_responses import error_event
from cllm.scaleout import routing

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-cllm-replica"  # which replica answered: its Ray replica id
REPLICA_PID_HEADER = "x-cllm-replica-pid"  # and its process, as the Ray dashboard lists it
REPORT_PERIOD = 2.0  # seconds between a replica's metrics reports to the board


@dataclass(frozen=True, slots=True)
class Plan:
    """How the application is laid out, from the command line (serve.py)."""
    replicas: int = 2
    fronts: int = 1  # Front replicas: each reads, routes and relays its share of the requests
    min_replicas: int | None = None  # with max_replicas: autoscale between them
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0  # per replica, what the autoscaler aims at
    max_ongoing_requests: int = 32  # per replica; more wait in the router
    router: str = "prefix"  # prefix: PrefixRouter; random: Ray's power of two choices
    prefix_chars: int = routing.PREFIX_CHARS
    load_factor: float = routing.LOAD_FACTOR
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    env_vars: dict = field(default_factory=dict)  # set in each replica's process

    def __post_init__(self) -> None:
        if self.router not in ("prefix", "random"):
            raise ValueError(f"routing must be prefix or random, got {self.router!r}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give both --min-replicas and --max-replicas, or neither")
        if self.min_replicas is not None and not 0 < self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 < min-replicas <= max-replicas")
        if self.replicas < 1 or self.fronts < 1 or self.max_ongoing_requests < 1:
            raise ValueError("replicas, front-replicas and max-ongoing-requests must be at "
                             "least 1")


class PrefixRouter(RequestRouter):
    """Ray's request router for Engine: a request with a routing key goes to its replica on
    a hash ring with bounded loads (routing.HashRing, passing over replicas with no free slot
    while another has one, and queueing where the fewest wait when all are full), and to the
    least loaded if that one refuses (at max_ongoing_requests); one without a key goes to the
    least loaded. Loads are Ray's queue-length cache: each replica's own in-flight count as it
    reported it when it last accepted one of this router's requests (or a probe), plus this
    router's sends since, minus its completions; other fronts' requests show at the next
    report."""

    def initialize_state(self, load_factor: float = routing.LOAD_FACTOR,
                         capacity: int | None = None) -> None:
        self.load_factor = load_factor
        self.capacity = capacity  # a replica's sequences decoded at once (--parallel)
        self.ring = routing.HashRing((), load_factor)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {i: self.replica_queue_len_cache.get(i) or 0 for i in by_id}
        key = pending_request.args[0] if pending_request and pending_request.args else None
        if key is None:
            return [candidate_replicas]  # Ray takes the shortest queue of a rank
        if self.ring.replicas != by_id.keys():
            self.ring = routing.HashRing(by_id, self.load_factor)
        first = self.ring.choose(key, loads, self.capacity)
        rest = [by_id[i] for i in routing.least_loaded(by_id, loads) if i != first]
        return [[by_id[first]], rest] if rest else [[by_id[first]]]


class Engine:
    """One cllm engine and its app. The constructor returns once the model is loaded, so Ray
    routes to a replica only when it can serve; a failed engine fails its health check, and
    Ray replaces the replica."""

    async def __init__(self, config: ServerConfig, board: DeploymentHandle) -> None:
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.app = app_for(config)
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()
        self.state = self.app.state.cllm
        model = self.state.models.default
        while model.status not in (LOADED, FAILED):
            await asyncio.sleep(0.1)
        if model.status == FAILED:
            raise RuntimeError(model.reason)
        self.board = board
        self.reporter = asyncio.create_task(self._report())

    async def __del__(self) -> None:
        """Ray awaits this when it stops the replica (scaled down, the application deleted):
        requests still running end as at the single server's shutdown, with a stated 503."""
        if hasattr(self, "reporter") and not self.reporter.done():
            self.reporter.cancel()
            await self.lifespan.__aexit__(None, None, None)

    def check_health(self) -> None:
        self.state.check_health()  # APIError with the reason once the engine failed

    async def _report(self) -> None:
        while True:
            try:
                await self.board.report.remote(self.name, self.state.render_metrics())
            except Exception as exc:  # the board restarting: the next report will do
                log.warning("metrics report failed: %s", exc)
            await asyncio.sleep(REPORT_PERIOD)

    async def forward(self, key: str | None, scope: dict, body: bytes
                      ) -> AsyncIterator[list[dict]]:
        """Run one HTTP request through the app and yield its ASGI messages, those that
        queued while the last batch travelled together, their bodies joined into one message
        (the front and Ray's proxy pay per message, whatever it holds). `key` is the router's
        (PrefixRouter); cancelling this (the client left) is a disconnect for the app."""
        queue: asyncio.Queue[dict | None] = asyncio.Queue()
        gone = asyncio.Event()
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if pending:
                return pending.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), self.name.encode()),
                                                  (REPLICA_PID_HEADER.encode(),
                                                   str(os.getpid()).encode())]}
            queue.put_nowait(message)

        app = asyncio.create_task(self.app(scope, receive, send))
        app.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            ended = False
            while not ended:
                batch, ended = await _drain(queue)
                if batch:
                    yield _joined(batch)
        finally:
            gone.set()


async def _drain(queue: asyncio.Queue) -> tuple[list[dict], bool]:
    """The messages queued (waiting for one), and whether the app has ended: its None comes
    last, often in the same batch as its last message."""
    batch = [await queue.get()]
    while not queue.empty():
        batch.append(queue.get_nowait())
    return [m for m in batch if m is not None], batch[-1] is None


def _joined(batch: list[dict]) -> list[dict]:
    """The batch with each run of body messages joined into one: the same bytes in order,
    `more_body` as the run's last message says."""
    joined: list[dict] = []
    for message in batch:
        last = joined[-1] if joined else {}
        if message["type"] == last.get("type") == "http.response.body" and last["more_body"]:
            last["body"] += message.get("body", b"")
            last["more_body"] = message.get("more_body", False)
        elif message["type"] == "http.response.body":  # a copy: the app's message stays as sent
            joined.append({"type": message["type"], "body": message.get("body", b""),
                           "more_body": message.get("more_body", False)})
        else:
            joined.append(message)
    return joined


class Front:
    """The ingress: reads a request, computes its routing key, relays it to an Engine replica
    and its answer back. /metrics answers from the board, merged over the replicas."""

    def __init__(self, config: ServerConfig, engine: DeploymentHandle, board: DeploymentHandle,
                 prefix_chars: int) -> None:
        self.config = config
        self.engine = engine.options(stream=True)
        self.board = board
        self.prefix_chars = prefix_chars
        self.metrics = self._metrics
        for cls, args, kwargs in reversed(access_checks(config)):  # the replicas' own checks
            self.metrics = cls(self.metrics, *args, **kwargs)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return ASGIResponse(self.metrics)
        try:
            body = await read_body(request, self.config)
        except APIError as error:
            return error_response(error, error_shape(path))
        scope = {key: request.scope[key] for key in _SCOPE_KEYS if key in request.scope}
        key = routing.route_key(request.headers, _json_or_none(body), self.prefix_chars)
        return Relay(self.engine.forward.remote(key, scope, body), path)

    async def _metrics(self, scope, receive, send) -> None:
        exposition = await self.board.render.remote()
        await Response(exposition, media_type=metrics.CONTENT_TYPE)(scope, receive, send)


class ASGIResponse(Response):
    """A response that an ASGI app makes (Ray serves what __call__ returns)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


# What of the ASGI scope travels to the replica (Ray's own entries stay here).
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path",
               "query_string", "root_path", "headers", "client", "server")


def _json_or_none(body: bytes) -> object:
    """The body's JSON, or None (the replica's app states what is wrong with it)."""
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


class Relay(Response):
    """Sends an Engine replica's ASGI messages on. If the replica dies (or cannot be reached)
    the client gets a stated 503, `replica_failed`: as the response if none had started,
    else as the last event of its stream, in the route's shape, so no client waits on a
    replica that is gone."""

    def __init__(self, messages: DeploymentResponseGenerator, path: str) -> None:
        self.messages = messages
        self.path = path
        # /v1/responses numbers its events: an error event must follow the last one relayed.
        self._numbered = path == "/v1/responses"
        self._next_sequence = 0

    async def __call__(self, scope, receive, send) -> None:
        started = False
        try:
            async for batch in self.messages:
                for message in batch:
                    started = started or message["type"] == "http.response.start"
                    if self._numbered and message["type"] == "http.response.body":
                        self._count_events(message.get("body", b""))
                    await send(message)
        except ray.exceptions.RayError as exc:
            log.warning("replica failed on %s: %s", self.path, exc)
            error = APIError(503, f"the replica serving this request failed: "
                             f"{type(exc).__name__}", type="server_error", code="replica_failed")
            if not started:
                await error_response(error, error_shape(self.path))(scope, receive, send)
                return
            await send({"type": "http.response.body", "body": self._stream_error(error),
                        "more_body": False})
        finally:
            self.messages.cancel()  # a no-op once it ended; else the replica sees a disconnect

    def _count_events(self, body: bytes) -> None:
        numbers = _SEQUENCE_NUMBER.findall(body)
        if numbers:
            self._next_sequence = int(numbers[-1]) + 1

    def _stream_error(self, error: APIError) -> bytes:
        if self._numbered:
            return typed_event(error_event(error, self._next_sequence))
        payload = error_shape(self.path)(error)
        return typed_event(payload) if "type" in payload else sse_event(payload)


# How a /v1/responses event numbers itself (responses.sse_event writes compact JSON).
_SEQUENCE_NUMBER = re.compile(rb'"sequence_number":(\d+)')


class Board:
    """The replicas' latest metrics, as each reported them; a replica that stopped reporting
    (gone, or replaced) drops out after three periods."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, bytes]] = {}

    def report(self, replica: str, exposition: bytes) -> None:
        self.reports[replica] = (time.monotonic(), exposition)

    def render(self) -> bytes:
        fresh = time.monotonic() - 3 * REPORT_PERIOD
        self.reports = {r: (t, text) for r, (t, text) in self.reports.items() if t >= fresh}
        return metrics.merge({r: text for r, (_, text) in self.reports.items()})


def application(config: ServerConfig, plan: Plan) -> serve.Application:
    """The Ray Serve application: Front → Engine replicas, with the Board."""
    board = serve.deployment(Board, name="Board", ray_actor_options={"num_cpus": 0}).bind()
    scaling = ({"autoscaling_config": AutoscalingConfig(
        min_replicas=plan.min_replicas, max_replicas=plan.max_replicas,
        target_ongoing_requests=plan.target_ongoing_requests)}
        if plan.min_replicas is not None else {"num_replicas": plan.replicas})
    router = ({"request_router_config": RequestRouterConfig(
        request_router_class=PrefixRouter,
        request_router_kwargs={"load_factor": plan.load_factor,
                               "capacity": config.engine.n_parallel})}
        if plan.router == "prefix" else {})
    engine = serve.deployment(
        Engine, name="Engine", max_ongoing_requests=plan.max_ongoing_requests,
        graceful_shutdown_timeout_s=config.shutdown_grace, health_check_period_s=5,
        ray_actor_options={"num_cpus": plan.cpus_per_replica,
                           "num_gpus": plan.gpus_per_replica,
                           "runtime_env": {"env_vars": plan.env_vars}},
        **scaling, **router).bind(config, board)
    front = serve.deployment(Front, name="Front", num_replicas=plan.fronts,
                             ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=config.max_connections)
    return front.bind(config, engine, board, plan.prefix_chars)
