"""The py-libp2p data-plane transport, node side: `gossip.transport.Transport` through a child process
(libp2p_child.py) that runs the libp2p host.

It starts the child and talks to it over local sockets (node/net/transport/control.py). Imports no libp2p:
that lives only in the child.

The child gets PR_SET_PDEATHSIG, so it dies with the node; the node notices the child's death at once
(its end of the control socketpair closes), fails every open stream, and calls `on_death`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gossip.limits import IncomingGate
from gossip.transport import PeerUnreachable, StreamHandler
from node.net.proc import create_subprocess_exec
from node.net.transport import control
from node.net.transport.p2pd import P2PDStream, _ByteCounts

logger = logging.getLogger(__name__)

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
CHILD_MODULE = "node.net.transport.libp2p_child"
# Read buffer of local stream connections; as in p2pd.py, asyncio's 64 KiB default costs throughput.
_READ_LIMIT = 1 << 22


def dht_identity_path(identity_path: Path) -> Path:
    """The key p2pd runs under when the py-libp2p child has the node's identity: `<identity>.dht`,
    created on first use. The node's identity lock covers it (only the lock's holder touches it)."""
    from node.net.identity import create_identity  # imports hivemind's protobufs: the node side only

    path = identity_path.with_name(identity_path.name + ".dht")
    if not path.exists():
        create_identity(path)
    return path


def data_listen_maddrs(listen: Sequence[str]) -> tuple[str, ...]:
    """The child's listen addresses for p2pd's: the same hosts on a port of its own (TCP only)."""
    hosts = []
    for addr in listen:
        parts = addr.strip("/").split("/")
        if len(parts) >= 4 and parts[0] in ("ip4", "ip6", "dns4", "dns6") and parts[2] == "tcp":
            host = f"/{parts[0]}/{parts[1]}/tcp/0"
            if host not in hosts:
                hosts.append(host)
    return tuple(hosts) or LOOPBACK_MADDRS


class ChildFailed(ConnectionError):
    """The py-libp2p child did not start, broke the control protocol, or died."""


@dataclass(frozen=True)
class LibP2PSettings:
    """How to start the child. Loopback only by default, like p2pd; never mDNS or UPnP."""

    identity_path: Path
    peer_id: str  # what the identity must give; the child refuses to start otherwise
    listen: tuple[str, ...] = LOOPBACK_MADDRS
    open_timeout_s: float = 10.0
    io_timeout_s: float = 30.0  # the child's bound on one read/write of a libp2p stream
    startup_timeout_s: float = 60.0  # importing libp2p takes a few seconds of CPU on a busy machine
    close_timeout_s: float = 5.0
    log_level: str = "warning"
    relays: tuple[str, ...] = ()  # behind NAT: the child reserves slots at these relays (full multiaddrs)


class LibP2PTransport:
    """`gossip.transport.Transport` through a py-libp2p child process. Use `await LibP2PTransport.start(...)`."""

    def __init__(self, settings: LibP2PSettings, on_death: Callable[[], None] | None,
                 gate: IncomingGate | None = None) -> None:
        self._settings = settings
        self._on_death = on_death
        self._gate = gate  # incoming streams pass it before their handler reads a byte
        self._dir = Path(tempfile.mkdtemp(prefix="murmur-libp2p-"))  # mode 0700: only we reach the sockets
        self._stream_socket = self._dir / "child.sock"
        self._node_socket = self._dir / "node.sock"
        self._process: asyncio.subprocess.Process | None = None
        self._control_writer: asyncio.StreamWriter | None = None
        self._server: asyncio.base_events.Server | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[None]] = {}
        self._next_id = 0
        self._maddrs: tuple[str, ...] = ()
        self._handlers: dict[str, StreamHandler] = {}
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._counts = _ByteCounts()
        self._streams: set[P2PDStream] = set()
        self._closed = False
        self.died: str | None = None  # why the child is gone, once it is
        self.errors: dict[str, int] = {}  # bad frames on local connections, by kind
        self.circuits: tuple[str, ...] = ()  # the child's addresses through relays holding a slot for it
        self.relayed: frozenset[str] = frozenset()  # peers the child reaches only through a relay
        self.on_state: Callable[[tuple[str, ...]], None] | None = None  # told the circuits when they change
        self._address_book: Callable[[str], Sequence[str]] | None = None

    # ---- life cycle ------------------------------------------------------------------------------

    @classmethod
    async def start(cls, settings: LibP2PSettings, *, on_death: Callable[[], None] | None = None,
                    gate: IncomingGate | None = None) -> LibP2PTransport:
        """Start the child and wait for its `ready`; ChildFailed if it does not come up. With `gate`,
        incoming streams pass it before their handler sees them (gossip.limits)."""
        transport = cls(settings, on_death, gate)
        try:
            await transport._start()
        except BaseException:
            await transport.close()
            raise
        return transport

    async def _start(self) -> None:
        settings = self._settings
        self._server = await asyncio.start_unix_server(self._on_incoming, str(self._node_socket), limit=_READ_LIMIT)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            args = ["-m", CHILD_MODULE, "--control-fd", str(theirs.fileno()), "--identity", str(settings.identity_path),
                    "--peer-id", settings.peer_id, "--stream-socket", str(self._stream_socket),
                    "--node-socket", str(self._node_socket), "--io-timeout", str(settings.io_timeout_s),
                    "--dial-timeout", str(settings.open_timeout_s), "--log-level", settings.log_level]
            for addr in settings.listen:
                args += ["--listen", addr]
            for relay in settings.relays:
                args += ["--relay", relay]
            self._process = await create_subprocess_exec(sys.executable, *args, pass_fds=(theirs.fileno(),),
                                                         stdin=asyncio.subprocess.DEVNULL)
        finally:
            theirs.close()
        reader, self._control_writer = await asyncio.open_unix_connection(sock=ours)
        try:
            async with asyncio.timeout(settings.startup_timeout_s):
                ready = await read_frame(reader, (control.Op.READY,))
        except TimeoutError:
            raise ChildFailed(f"the py-libp2p child did not start within {settings.startup_timeout_s:g} s") from None
        if ready is None:
            code = await self._exit_code()
            raise ChildFailed(f"the py-libp2p child exited with status {code} before it was ready (see its stderr)")
        assert isinstance(ready, control.Ready)
        if ready.peer_id != settings.peer_id:
            raise ChildFailed(f"the py-libp2p child runs as {ready.peer_id}, not {settings.peer_id}")
        self._maddrs = ready.maddrs
        self._watcher = asyncio.create_task(self._watch(reader), name="libp2p-child-watch")
        logger.info("py-libp2p child (pid %d) ready on %s", self._process.pid, " ".join(self._maddrs))

    async def _exit_code(self) -> int | None:
        if self._process is None:
            return None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._settings.close_timeout_s):
                return await self._process.wait()
        return None

    async def _watch(self, reader: asyncio.StreamReader) -> None:
        """Read the child's answers until its end closes; then it is gone, and everyone is told."""
        reason = "its control channel closed"
        try:
            while True:
                frame = await read_frame(reader, (control.Op.RESULT, control.Op.STATE))
                if frame is None:
                    break
                if isinstance(frame, control.State):
                    changed = frame.circuits != self.circuits
                    self.circuits, self.relayed = frame.circuits, frozenset(frame.relayed)
                    if changed and self.on_state is not None:
                        self.on_state(self.circuits)
                    continue
                assert isinstance(frame, control.Result)
                future = self._pending.pop(frame.id, None)
                if future is None or future.done():
                    continue
                if frame.ok:
                    future.set_result(None)
                else:
                    future.set_exception(PeerUnreachable(frame.error))
        except (control.ControlError, ConnectionError, OSError) as exc:
            reason = f"it broke the control protocol: {exc}"
        if self._closed:
            return
        code = await self._exit_code()
        pid = self._process.pid if self._process is not None else None
        self.died = f"the py-libp2p child (pid {pid}) is gone: {reason}, exit status {code}"
        logger.error("%s; the node's data plane is down", self.died)
        self._fail_everything(ChildFailed(self.died))
        if self._on_death is not None:
            self._on_death()

    def _fail_everything(self, exc: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
        self._pending.clear()
        for stream in list(self._streams):
            stream.abort()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_everything(ChildFailed("the transport is closed"))
        if self._watcher is not None:
            self._watcher.cancel()
        if self._server is not None:
            self._server.close()
        tasks = set(self._handler_tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self._settings.close_timeout_s)
        await self._stop_child()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _stop_child(self) -> None:
        process = self._process
        if process is None:
            return
        if process.returncode is None and self._control_writer is not None:
            with contextlib.suppress(ConnectionError, OSError, TimeoutError):
                self._control_writer.write(control.encode(control.Op.STOP))
                async with asyncio.timeout(1.0):
                    await self._control_writer.drain()
        if self._control_writer is not None:
            self._control_writer.transport.abort()  # the child also stops when its end closes
        try:
            async with asyncio.timeout(self._settings.close_timeout_s):
                await process.wait()
        except TimeoutError:
            logger.warning("py-libp2p child (pid %d) did not stop in time; killing it", process.pid)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    # ---- the Transport interface -------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self._settings.peer_id

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def bytes_sent(self) -> int:
        return self._counts.sent

    @property
    def bytes_received(self) -> int:
        return self._counts.received

    def goodput_mbit_s(self, peer_id: str) -> float | None:
        """How fast gossip payloads arrived from `peer_id` lately (None: no large transfer yet)."""
        return self._counts.goodput.mbit_s(peer_id)

    async def maddrs(self) -> tuple[str, ...]:
        """Full multiaddrs of the child's host, each ending in /p2p/<peer id>."""
        return self._maddrs

    async def connect(self, peer_id: str, maddrs: Sequence[str]) -> None:
        """Dial `peer_id` at `maddrs` (e.g. from its DHT record) so later streams find it."""
        await self._request(control.Op.CONNECT, peer=peer_id, maddrs=list(maddrs), timeout=self._settings.open_timeout_s)

    async def serve(self, protocol: str, handler: StreamHandler) -> None:
        if protocol in self._handlers:
            raise ValueError(f"{protocol} is already served")
        self._handlers[protocol] = handler if self._gate is None else self._gate.guard(handler)
        try:
            await self._request(control.Op.SERVE, protocol=protocol)
        except BaseException:
            del self._handlers[protocol]
            raise

    async def _request(self, op: control.Op, **fields: object) -> None:
        writer = self._require_running()
        request_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with asyncio.timeout(self._settings.open_timeout_s + 1.0):
                writer.write(control.encode(op, id=request_id, **fields))
                await writer.drain()
                await future
        except TimeoutError:
            raise PeerUnreachable(f"the py-libp2p child did not answer {op} in time") from None
        finally:
            self._pending.pop(request_id, None)

    def set_address_book(self, addresses: Callable[[str], Sequence[str]]) -> None:
        """Where each peer can be dialled (its DHT record's maddrs), for a stream that cannot be opened on
        the child's current connections (see node.net.transport.p2pd.P2PDTransport.set_address_book)."""
        self._address_book = addresses

    async def open_stream(self, peer_id: str, protocol: str) -> P2PDStream:
        try:
            return await self._open_stream(peer_id, protocol)
        except PeerUnreachable as first:
            maddrs = self._address_book(peer_id) if self._address_book is not None else ()
            if not maddrs or self._closed:
                raise
            try:
                await self.connect(peer_id, maddrs)
            except PeerUnreachable:
                raise first from None
            logger.info("re-dialled %s to open a %s stream", peer_id, protocol)
            return await self._open_stream(peer_id, protocol)

    async def _open_stream(self, peer_id: str, protocol: str) -> P2PDStream:
        self._require_running()
        writer = None
        try:
            async with asyncio.timeout(self._settings.open_timeout_s + 1.0):
                reader, writer = await asyncio.open_unix_connection(str(self._stream_socket), limit=_READ_LIMIT)
                writer.write(control.encode(control.Op.OPEN, peer=peer_id, protocol=protocol,
                                            timeout=self._settings.open_timeout_s))
                answer = await read_frame(reader, (control.Op.OPENED, control.Op.ERROR))
        except TimeoutError:
            _abort(writer)
            raise PeerUnreachable(f"no {protocol} stream to {peer_id}: timed out") from None
        except (control.ControlError, ConnectionError, OSError) as exc:
            _abort(writer)
            raise PeerUnreachable(f"no {protocol} stream to {peer_id}: {exc}") from exc
        except BaseException:
            _abort(writer)
            raise
        if not isinstance(answer, control.Opened):
            _abort(writer)
            why = answer.error if isinstance(answer, control.Error) else "the child hung up"
            raise PeerUnreachable(f"no {protocol} stream to {peer_id}: {why}")
        return P2PDStream(peer_id, reader, writer, self._counts, self._streams, self._settings.close_timeout_s)

    def _require_running(self) -> asyncio.StreamWriter:
        """The control channel's writer; RuntimeError once closed, ChildFailed once the child is gone."""
        if self._closed or self._control_writer is None:
            raise RuntimeError("transport is closed")
        if self.died is not None:
            raise ChildFailed(self.died)
        return self._control_writer

    async def _on_incoming(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A stream the child accepted: an `incoming` frame, then the stream's bytes."""
        try:
            async with asyncio.timeout(self._settings.io_timeout_s):
                frame = await read_frame(reader, (control.Op.INCOMING,))
        except (TimeoutError, control.ControlError, ConnectionError, OSError) as exc:
            self.errors["bad_local_stream"] = self.errors.get("bad_local_stream", 0) + 1
            logger.warning("dropping a local stream connection from the child: %s", exc or type(exc).__name__)
            writer.transport.abort()
            return
        handler = self._handlers.get(frame.protocol) if isinstance(frame, control.Incoming) else None
        if frame is None or handler is None:
            writer.transport.abort()
            return
        assert isinstance(frame, control.Incoming)
        stream = P2PDStream(frame.peer, reader, writer, self._counts, self._streams, self._settings.close_timeout_s)
        task = asyncio.current_task()
        assert task is not None  # asyncio runs each connection's callback in a task of its own
        self._handler_tasks.add(task)
        try:
            await handler(stream)
        except Exception:
            # A handler must deal with bad peers itself; this only keeps a bug from going silent.
            logger.exception("%s handler failed on a stream from %s", frame.protocol, stream.remote_peer)
            stream.abort()
            return
        except BaseException:
            stream.abort()
            raise
        finally:
            self._handler_tasks.discard(task)
        await stream.close()


async def read_frame(reader: asyncio.StreamReader, expect: tuple[control.Op, ...]) -> control.Frame | None:
    """One control frame, or None at a clean end of stream before it; ControlError if it is bad."""
    try:
        prefix = await reader.readexactly(control.LENGTH_BYTES)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise control.ControlError("local connection closed inside a frame") from None
        return None
    try:
        body = await reader.readexactly(control.frame_length(prefix))
    except asyncio.IncompleteReadError:
        raise control.ControlError("local connection closed inside a frame") from None
    return control.decode_body(body, expect)


def _abort(writer: asyncio.StreamWriter | None) -> None:
    if writer is not None:
        writer.transport.abort()
