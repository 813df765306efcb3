"""A delaying TCP relay for the emulated WAN (bench/wan_net.py): it forwards each connection to its home,
holding every chunk for a fixed one-way delay in each direction.

It listens on one port per home in the hub namespace. Bounded: at most MAX_CONNECTIONS connections, at
most BUFFER_BYTES held per direction (reading pauses beyond it), a deadline on every dial, and it ends on
SIGTERM or when its parent dies.

Run by the benchmark inside the hub: python -m bench.wan_relay --delay-ms D --route HOST:PORT=HOST:PORT ...
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import signal
import sys
import time

MAX_CONNECTIONS = 512
BUFFER_BYTES = 4 << 20  # held per direction; 20 Mbit/s x 25 ms is 62 KB, so this never paces a link
READ_BYTES = 64 << 10
DIAL_TIMEOUT_S = 10.0


class DelayedPipe:
    """One direction of a connection: chunks read from `reader` are written to `writer` `delay_s` later."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
        self.reader, self.writer, self.delay_s = reader, writer, delay_s
        self.held: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held_bytes = 0
        self.changed = asyncio.Event()
        self.ended = False

    async def read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while self.held_bytes >= BUFFER_BYTES:
                    self.changed.clear()
                    await self.changed.wait()
                data = await self.reader.read(READ_BYTES)
                if not data:
                    break
                self.held.append((loop.time() + self.delay_s, data))
                self.held_bytes += len(data)
                self.changed.set()
        finally:
            self.ended = True
            self.changed.set()

    async def write(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.held:
                if self.ended:
                    break
                self.changed.clear()
                await self.changed.wait()
                continue
            due, data = self.held[0]
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            self.held.popleft()
            self.held_bytes -= len(data)
            self.changed.set()
            self.writer.write(data)
            await self.writer.drain()
        with contextlib.suppress(OSError):
            if self.writer.can_write_eof():
                self.writer.write_eof()


class Relay:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.connections = 0
        self.refused = 0

    def handler(self, target: tuple[str, int]):
        async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
            if self.connections >= MAX_CONNECTIONS:
                self.refused += 1
                client_writer.close()
                return
            self.connections += 1
            upstream_writer = None
            try:
                async with asyncio.timeout(DIAL_TIMEOUT_S):
                    upstream_reader, upstream_writer = await asyncio.open_connection(*target)
                pipes = (DelayedPipe(client_reader, upstream_writer, self.delay_s),
                         DelayedPipe(upstream_reader, client_writer, self.delay_s))
                async with asyncio.TaskGroup() as group:
                    for pipe in pipes:
                        group.create_task(pipe.read())
                        group.create_task(pipe.write())
            except (OSError, TimeoutError, ExceptionGroup):
                pass  # a reset or a dead home ends this connection only
            finally:
                self.connections -= 1
                for writer in (client_writer, upstream_writer):
                    if writer is not None:
                        writer.close()

        return handle


async def serve(routes: list[tuple[str, int, str, int]], delay_s: float) -> None:
    relay = Relay(delay_s)  # started with node.net.proc.popen: it dies with the benchmark
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    servers = [await asyncio.start_server(relay.handler((th, tp)), lh, lp) for lh, lp, th, tp in routes]
    print(f"relay ready: {len(servers)} routes, {delay_s * 1000:g} ms each way", flush=True)
    started = time.monotonic()
    await stop.wait()
    for server in servers:
        server.close()
    print(f"relay stopped after {time.monotonic() - started:.0f} s; {relay.refused} connections refused", flush=True)


def parse_route(text: str) -> tuple[str, int, str, int]:
    listen, _, target = text.partition("=")
    lh, _, lp = listen.rpartition(":")
    th, _, tp = target.rpartition(":")
    return lh, int(lp), th, int(tp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wan_relay", description=__doc__)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--route", action="append", type=parse_route, required=True,
                        help="LISTEN_HOST:PORT=TARGET_HOST:PORT, repeatable")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    asyncio.run(serve(args.route, args.delay_ms / 1000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
