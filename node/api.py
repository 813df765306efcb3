"""The node's local HTTP API (aiohttp, in the node's event loop): `/api/status` for `murmur status`.

Bound to 127.0.0.1 unless the monitor host says otherwise. The monitor page grows on this server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

StatusFn = Callable[[], dict]


@dataclass(frozen=True)
class ApiServer:
    runner: web.AppRunner
    url: str

    async def close(self) -> None:
        async with asyncio.timeout(5):
            await self.runner.cleanup()


def build_app(status: StatusFn) -> web.Application:
    async def get_status(_: web.Request) -> web.Response:
        return web.json_response(status(), dumps=lambda obj: json.dumps(obj, allow_nan=False))

    app = web.Application()
    app.router.add_get("/api/status", get_status)
    return app


async def start_api(status: StatusFn, host: str, port: int) -> ApiServer:
    """Start serving; port 0 picks a free port, reported in the returned url."""
    runner = web.AppRunner(build_app(status), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=False)
    await site.start()
    bound_port = site._server.sockets[0].getsockname()[1]  # aiohttp exposes the bound port only here
    shown = f"[{host}]" if ":" in host else host
    return ApiServer(runner, f"http://{shown}:{bound_port}")
