"""The monitor's web server (aiohttp, in the node's event loop): the page, the JSON API, server-sent events
and `/metrics`, plus the sampler that appends a history sample and pushes an update every interval.

Bound to 127.0.0.1 unless the node is told otherwise (`--monitor-host`); answers only the Host names
node.monitor.access allows, and POSTs only with the run's token."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, cast

from aiohttp import web
from aiohttp.typedefs import Handler

from node.config import Boolean
from node.monitor.access import MAX_EVENT_CLIENTS, AccessRefusal, HostAllowlist, new_token, token_matches
from node.monitor.eventlog import LogCapture, Snapshot, log_changes
from node.monitor.metrics import CONTENT_TYPE, exposition, metrics_registry
from node.monitor.schemas import openapi_document
from node.monitor.source import DoctorUnavailable, MonitorSource
from node.monitor.swarm_view import SwarmHistory, swarm_document, swarm_peers
from node.swarm.swarm_eval import EvalBusy, EvalUnavailable

logger = logging.getLogger("murmur.monitor")

SAMPLE_INTERVAL_S = 1.0  # the page updates within 2 s of a change
SSE_KEEPALIVE_S = 10.0
SSE_WRITE_TIMEOUT_S = 5.0  # a client that does not read is dropped
SHUTDOWN_TIMEOUT_S = 1.0
STATIC_FILES = {"/": ("index.html", "text/html"), "/monitor.js": ("monitor.js", "text/javascript"),
                "/monitor.css": ("monitor.css", "text/css")}
# the page loads nothing from elsewhere: users may be offline, and nothing should phone out
PAGE_POLICY = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"


class BadQuery(ValueError):
    """A query string the endpoint does not accept (answered with 400)."""


def _foreign_origin(request: web.Request) -> str | None:
    """The Origin a browser sent with `request` when it is another page's than the monitor's own, else None."""
    origin = request.headers.get("Origin")
    return origin if origin is not None and origin != f"{request.scheme}://{request.host}" else None


def _dumps(obj: object) -> str:
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))


def _json(obj: object, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status, dumps=_dumps)


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message, "status": status}, status=status)


def _parse_query(query: Mapping[str, str], allowed: Mapping[str, Callable[[str], Any]]) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for key in query:
        if key not in allowed:
            accepted = ", ".join(sorted(allowed)) or "none"
            raise BadQuery(f"unknown query parameter {key!r} (accepted: {accepted})")
        values = query.getall(key) if hasattr(query, "getall") else [query[key]]
        if len(values) != 1:
            raise BadQuery(f"query parameter {key!r} given {len(values)} times")
        try:
            parsed[key] = allowed[key](values[0])
        except ValueError as exc:
            raise BadQuery(f"query parameter {key}={values[0]!r}: {exc}") from None
    return parsed


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be an integer >= 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be an integer >= 0")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("must be a finite number")
    return value


class Sampler:
    """Once per interval: a history sample, the change log, and the update message every SSE client gets."""

    def __init__(self, source: MonitorSource, interval_s: float) -> None:
        self.source = source
        self.interval_s = interval_s
        self.closed = False
        self.message = ""  # the latest update, as SSE data
        self.seq = 0
        self.failures = 0
        self._failing = 0  # failures in a row
        self._tick = asyncio.Event()
        self._snapshot: Snapshot | None = None
        self._log_seen = 0
        self.swarm = SwarmHistory()  # the swarm page's loss and throughput over time

    @property
    def tick(self) -> asyncio.Event:
        """Set when the next message is out (a fresh event each interval)."""
        return self._tick

    def sample_once(self, now: float) -> None:
        source = self.source
        status = source.status()
        sample = source.history.tick(source.counters(), now)
        snapshot = Snapshot(frozenset(p["peer_id"] for p in status["peers"]), dict(status["errors"]),
                            dict(status["skipped"]), status["gossip_from"])
        log_changes(source.events, self._snapshot, snapshot, now)
        self._snapshot = snapshot
        fresh = source.events.entries(after=self._log_seen)
        if fresh:
            self._log_seen = fresh[-1].id
        self.seq += 1
        peers = source.peers()
        rows = swarm_peers(peers, status.get("contribution"))
        point = self.swarm.tick(rows, now)
        swarm = swarm_document(rows, [point], me=status["peer_id"], interval_s=self.interval_s,
                               capacity=self.swarm.capacity, now=now)
        self.message = _dumps({"seq": self.seq, "status": status, "peers": peers, "topology": source.topology(),
                               "sample": sample.as_json(), "log": [e.as_json() for e in fresh], "swarm": swarm})
        self._publish()

    def _publish(self) -> None:
        done, self._tick = self._tick, asyncio.Event()
        done.set()

    async def refresh_safely(self) -> None:
        """The source's topology brought up to date (in a thread); a failure is logged, and the last
        graph stays."""
        try:
            await self.source.refresh_topology()
        except Exception:
            logger.debug("monitor topology refresh failed", exc_info=True)

    def sample_safely(self) -> None:
        """sample_once, but a failure is logged and counted: it must not end the page's updates."""
        try:
            self.sample_once(time.time())
        except Exception:
            self.failures += 1
            self._failing += 1
            # the traceback once per outage, not once a second
            logger.log(logging.ERROR if self._failing == 1 else logging.DEBUG, "monitor sample failed (%d so far)",
                       self.failures, exc_info=True)
        else:
            if self._failing:
                logger.warning("monitor samples work again after %d failures", self._failing)
            self._failing = 0

    async def run(self) -> None:
        while not self.closed:
            await asyncio.sleep(self.interval_s)
            await self.refresh_safely()
            self.sample_safely()

    def close(self) -> None:
        self.closed = True
        self._publish()  # wakes every SSE handler, which then sees `closed`


@dataclass
class MonitorServer:
    runner: web.AppRunner
    url: str
    sampler: Sampler
    task: asyncio.Task[None]
    capture: LogCapture
    token: str  # POST requests need it (Authorization: Bearer <token>)

    async def close(self) -> None:
        self.sampler.close()
        self.task.cancel()
        logging.getLogger().removeHandler(self.capture)
        async with asyncio.timeout(5):
            await asyncio.gather(self.task, return_exceptions=True)
            await self.runner.cleanup()


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def build_app(source: MonitorSource, sampler: Sampler, *, host: str = "127.0.0.1", token: str | None = None,
              max_event_clients: int = MAX_EVENT_CLIENTS) -> web.Application:
    """The monitor's app, answering Host names `HostAllowlist(host)` allows and POSTs with `token`
    (a fresh one that no client knows when None)."""
    bad_requests = [0]  # one cell per app: the middleware counts, /metrics reads
    refused: collections.Counter[str] = collections.Counter()  # by AccessRefusal
    event_clients = [0]
    allowlist = HostAllowlist(host)
    secret = token if token is not None else new_token()
    registry = metrics_registry(source, lambda: bad_requests[0], lambda: dict(refused))
    pages = {path: (_static(name), kind) for path, (name, kind) in STATIC_FILES.items()}

    @web.middleware
    async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not allowlist.allows(request.headers.get("Host")):
            refused[AccessRefusal.HOST] += 1
            logger.info("monitor: 403 for Host %r (%s %s)", request.headers.get("Host"), request.method, request.path)
            return _error(403, f"this monitor answers to loopback names and {host!r}, not to the Host "
                               f"{request.headers.get('Host')!r}")
        # (a path or method that does not exist gets its 404/405 from the router, token or not)
        routed = request.match_info.http_exception is None
        if routed and request.method == "POST" and not token_matches(request.headers.get("Authorization"), secret):
            refused[AccessRefusal.TOKEN] += 1
            logger.info("monitor: 401 for %s %s without this run's token", request.method, request.path)
            response = _error(401, "POST needs this run's monitor token (Authorization: Bearer <token>, from "
                                   "<data-dir>/monitor.token; murmur eval reads it)")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await handler(request)

    @web.middleware
    async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadQuery as exc:
            bad_requests[0] += 1
            logger.info("monitor: 400 for %s: %s", request.path_qs, exc)
            return _error(400, str(exc))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error(exc.status, exc.reason)
        except Exception:
            logger.exception("monitor: %s failed", request.path_qs)
            return _error(500, "internal error (see the node's log)")

    async def page(request: web.Request) -> web.Response:
        _parse_query(request.query, {})
        body, kind = pages[request.path]
        return web.Response(body=body, content_type=kind, charset="utf-8",
                            headers={"Content-Security-Policy": PAGE_POLICY, "Cache-Control": "no-cache"})

    def endpoint(produce: Callable[[dict[str, Any]], object],
                 query: Mapping[str, Callable[[str], Any]]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            return _json(produce(_parse_query(request.query, query)))
        return handler

    def history(q: dict[str, Any]) -> dict[str, Any]:
        samples = source.history.samples(since=q.get("since"), limit=q.get("limit"))
        return {"interval_s": sampler.interval_s, "capacity": source.history.capacity,
                "samples": [s.as_json() for s in samples]}

    def peers(_: dict[str, Any]) -> dict[str, Any]:
        view = source.peers()
        me = next((p["peer_id"] for p in view if p["self"]), source.status()["peer_id"])
        return {"self": me, "now": time.time(), "record_ttl_s": source.record_ttl_s, "peers": view}

    def swarm(q: dict[str, Any]) -> dict[str, Any]:
        status = source.status()
        return swarm_document(swarm_peers(source.peers(), status.get("contribution")),
                              sampler.swarm.points(limit=q.get("limit")), me=status["peer_id"],
                              interval_s=sampler.interval_s, capacity=sampler.swarm.capacity, now=time.time())

    async def metrics(request: web.Request) -> web.Response:
        _parse_query(request.query, {})
        await sampler.refresh_safely()
        body = await asyncio.to_thread(exposition, registry)  # collect() only reads: safe off the loop
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def events(request: web.Request) -> web.StreamResponse:
        _parse_query(request.query, {})
        if (origin := _foreign_origin(request)) is not None:
            # a page elsewhere in the user's browser could hold every place and leave the monitor's own
            # page none (browsers send Origin with a cross-origin EventSource)
            refused[AccessRefusal.ORIGIN] += 1
            return _error(403, f"a page at {origin} may not open this node's event stream")
        if event_clients[0] >= max_event_clients:
            refused[AccessRefusal.EVENT_CLIENTS] += 1
            logger.info("monitor: 503 for an event stream: %d are open", event_clients[0])
            response = _error(503, f"{max_event_clients} event streams are open already; try again later")
            response.headers["Retry-After"] = "5"
            return response
        event_clients[0] += 1
        try:
            return await _event_stream(request)
        finally:
            event_clients[0] -= 1

    async def _event_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        sent = -1
        try:
            await _write(response, f"retry: {int(sampler.interval_s * 1000)}\n\n")
            while not sampler.closed:
                if sampler.seq != sent and sampler.message:
                    sent = sampler.seq
                    await _write(response, f"id: {sent}\nevent: update\ndata: {sampler.message}\n\n")
                tick = sampler.tick
                try:
                    async with asyncio.timeout(SSE_KEEPALIVE_S):
                        await tick.wait()
                except TimeoutError:
                    await _write(response, ": keepalive\n\n")
        except (ConnectionError, TimeoutError):
            pass  # the client went away or stopped reading
        return response

    async def swarm_average(request: web.Request) -> web.Response:
        query = _parse_query(request.query, {"save": Boolean().from_text})
        if (origin := _foreign_origin(request)) is not None:
            # a page elsewhere in the user's browser may POST here without reading the answer; it must
            # not be able to make the node pull every peer's parameters over and over
            return _error(403, f"a request from the page at {origin} may not start an evaluation")
        try:
            return _json(await source.evaluate_swarm_average(save=query.get("save", False)))
        except EvalBusy as exc:
            return _error(409, str(exc))
        except EvalUnavailable as exc:
            return _error(422, str(exc))

    async def doctor(request: web.Request) -> web.Response:
        _parse_query(request.query, {})
        if (origin := _foreign_origin(request)) is not None:
            return _error(403, f"a request from the page at {origin} may not start reachability checks")
        try:
            return _json(await source.doctor())
        except DoctorUnavailable as exc:
            return _error(409, str(exc))

    async def topology(request: web.Request) -> web.Response:
        _parse_query(request.query, {})
        await sampler.refresh_safely()
        return _json(source.topology())

    app = web.Application(middlewares=[access, json_errors])
    for path in STATIC_FILES:
        app.router.add_get(path, page)
    app.router.add_get("/api/status", endpoint(lambda _: source.status(), {}))
    app.router.add_get("/api/peers", endpoint(peers, {}))
    app.router.add_get("/api/topology", topology)
    app.router.add_get("/api/history", endpoint(history, {"since": _finite_float, "limit": _positive_int}))
    app.router.add_get("/api/swarm", endpoint(swarm, {"limit": _positive_int}))
    app.router.add_get("/api/log", endpoint(
        lambda q: {"entries": [e.as_json() for e in source.events.entries(q.get("after", 0), q.get("limit"))]},
        {"after": _non_negative_int, "limit": _positive_int}))
    app.router.add_get("/api/openapi.json", endpoint(lambda _: openapi_document(), {}))
    app.router.add_get("/api/events", events)
    app.router.add_post("/api/eval/average", swarm_average)
    app.router.add_post("/api/doctor", doctor)
    app.router.add_get("/metrics", metrics)
    return app


async def _write(response: web.StreamResponse, text: str) -> None:
    async with asyncio.timeout(SSE_WRITE_TIMEOUT_S):
        await response.write(text.encode())


async def start_monitor(source: MonitorSource, host: str, port: int, interval_s: float = SAMPLE_INTERVAL_S, *,
                        token: str | None = None, max_event_clients: int = MAX_EVENT_CLIENTS) -> MonitorServer:
    """Start serving and sampling; port 0 picks a free port, reported in the returned url. POSTs need
    `token` (a fresh one when None: `MonitorServer.token`)."""
    token = token if token is not None else new_token()
    sampler = Sampler(source, interval_s)
    await sampler.refresh_safely()
    sampler.sample_safely()  # the page has something to show from its first request
    runner = web.AppRunner(build_app(source, sampler, host=host, token=token, max_event_clients=max_event_clients), access_log=None, handle_signals=False,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    server = cast(asyncio.Server, site._server)  # aiohttp exposes the bound port only here
    bound_port = server.sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    capture = LogCapture(source.events)
    logging.getLogger().addHandler(capture)
    task = asyncio.create_task(sampler.run(), name="monitor sampler")
    return MonitorServer(runner, f"http://{shown}:{bound_port}", sampler, task, capture, token)
