"""Tests for gossip.memory: the in-memory Transport (streams, link delays, loss, freeze, kill, byte counts)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gossip.memory import InMemoryNetwork, LinkModel
from gossip.transport import GOSSIP_PROTOCOL, Stream, StreamClosed

pytestmark = pytest.mark.unit

# Timers may fire up to the loop's clock resolution early; nothing else makes them early.
EARLY = 1e-6


def run(main: Callable[[], Awaitable[None]], limit_s: float = 10.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(limit_s):
            await main()

    asyncio.run(bounded())


async def echo_upper(stream: Stream) -> None:
    """Read a 1-byte length and that many bytes; answer with them upper-cased, until the stream ends."""
    while True:
        try:
            size = (await stream.read_exactly(1))[0]
        except StreamClosed:
            return
        payload = await stream.read_exactly(size)
        await stream.write(payload.upper())


def test_bytes_round_trip_in_both_directions_in_order() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        a, b = net.transport("a"), net.transport("b")
        seen_remote: list[str] = []

        async def handler(stream: Stream) -> None:
            seen_remote.append(stream.remote_peer)
            await echo_upper(stream)

        await b.serve(GOSSIP_PROTOCOL, handler)
        stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        words = [b"alpha", b"beta", b"gamma", b"", b"delta" * 40]
        for word in words:
            await stream.write(bytes([len(word)]))
            await stream.write(memoryview(word))
        replies = [await stream.read_exactly(len(word)) for word in words]

        assert replies == [word.upper() for word in words]
        assert stream.remote_peer == "b" and seen_remote == ["a"]
        await a.close()
        await b.close()

    run(main)


def test_written_buffer_may_be_reused_after_write_returns() -> None:
    async def main() -> None:
        net = InMemoryNetwork(LinkModel(latency_s=0.05))
        a, b = net.transport("a"), net.transport("b")
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def handler(stream: Stream) -> None:
            got.set_result(await stream.read_exactly(4))

        await b.serve(GOSSIP_PROTOCOL, handler)
        stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        buffer = bytearray(b"sent")
        await stream.write(memoryview(buffer))
        buffer[:] = b"XXXX"  # overwritten while the bytes are still in flight

        assert await got == b"sent"
        await a.close()
        await b.close()

    run(main)


def test_latency_delays_each_direction() -> None:
    async def main() -> None:
        net = InMemoryNetwork(LinkModel(latency_s=0.2))
        a, b = net.transport("a"), net.transport("b")
        loop = asyncio.get_running_loop()
        request_arrived: asyncio.Future[float] = loop.create_future()

        async def handler(stream: Stream) -> None:
            await stream.read_exactly(4)
            request_arrived.set_result(loop.time())
            await stream.write(b"pong")

        await b.serve(GOSSIP_PROTOCOL, handler)
        opened_at = loop.time()
        stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        sent_at = loop.time()
        await stream.write(b"ping")
        reply = await stream.read_exactly(4)
        replied_at = loop.time()

        assert reply == b"pong"
        assert sent_at - opened_at >= 0.2 - EARLY  # the dial crosses the link once
        assert await request_arrived - sent_at >= 0.2 - EARLY
        assert replied_at - sent_at >= 0.4 - EARLY
        await a.close()
        await b.close()

    run(main)


def test_bandwidth_delays_writes_and_serialises_streams_on_one_direction() -> None:
    async def main() -> None:
        net = InMemoryNetwork(LinkModel(bandwidth_bytes_per_s=1_000_000))
        a, b = net.transport("a"), net.transport("b")
        loop = asyncio.get_running_loop()
        arrivals: list[float] = []

        async def sink(stream: Stream) -> None:
            await stream.read_exactly(100_000)
            arrivals.append(loop.time())

        await b.serve(GOSSIP_PROTOCOL, sink)
        first = await a.open_stream("b", GOSSIP_PROTOCOL)
        second = await a.open_stream("b", GOSSIP_PROTOCOL)
        start = loop.time()
        async with asyncio.TaskGroup() as group:
            group.create_task(first.write(bytes(100_000)))
            group.create_task(second.write(bytes(100_000)))
        writes_done = loop.time()
        while len(arrivals) < 2:
            await asyncio.sleep(0.01)

        # 200 kB through one 1 MB/s direction: 0.2 s, however it is split across streams.
        assert writes_done - start >= 0.2 - EARLY
        assert sorted(arrivals)[0] - start >= 0.1 - EARLY
        assert sorted(arrivals)[1] - start >= 0.2 - EARLY
        await a.close()
        await b.close()

    run(main)


def test_per_link_override_applies_to_that_pair_only() -> None:
    net = InMemoryNetwork(LinkModel(latency_s=0.01))
    slow = LinkModel(latency_s=0.5)
    one_way = LinkModel(loss=0.5)

    net.set_link("a", "c", slow)
    net.set_link("b", "c", one_way, both_directions=False)

    assert net.link("a", "c") == slow and net.link("c", "a") == slow
    assert net.link("b", "c") == one_way and net.link("c", "b") == LinkModel(latency_s=0.01)
    assert net.link("a", "b") == LinkModel(latency_s=0.01)


def test_per_link_latency_is_observed() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        net.set_link("a", "far", LinkModel(latency_s=0.2))
        a, far = net.transport("a"), net.transport("far")
        await far.serve(GOSSIP_PROTOCOL, echo_upper)
        loop = asyncio.get_running_loop()

        start = loop.time()
        stream = await a.open_stream("far", GOSSIP_PROTOCOL)
        await stream.write(b"\x01x")
        assert await stream.read_exactly(1) == b"X"

        assert loop.time() - start >= 0.6 - EARLY  # dial + request + reply
        await a.close()
        await far.close()

    run(main)


async def count_failed_opens(net: InMemoryNetwork, opens: int) -> list[bool]:
    a, b = net.transport("a"), net.transport("b")
    await b.serve(GOSSIP_PROTOCOL, echo_upper)
    failed = []
    for _ in range(opens):
        try:
            stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        except ConnectionError as error:
            assert "dropped" in str(error)
            failed.append(True)
        else:
            await stream.close()
            failed.append(False)
    await a.close()
    await b.close()
    return failed


def test_loss_fails_about_that_fraction_of_opens_reproducibly() -> None:
    outcomes: dict[int, list[bool]] = {}

    async def main() -> None:
        for seed in (7, 7, 8):
            outcomes.setdefault(seed, [])
            result = await count_failed_opens(InMemoryNetwork(LinkModel(loss=0.3), rng=seed), 200)
            if outcomes[seed]:
                assert result == outcomes[seed], "same seed must replay the same losses"
            outcomes[seed] = result

    run(main)
    for pattern in outcomes.values():
        assert 40 <= sum(pattern) <= 80  # 60 expected; the binomial sd is about 6.5
    assert outcomes[7] != outcomes[8]


def test_lost_open_never_reaches_the_handler() -> None:
    async def main() -> None:
        net = InMemoryNetwork(LinkModel(loss=1.0))
        a, b = net.transport("a"), net.transport("b")
        calls = 0

        async def handler(stream: Stream) -> None:
            nonlocal calls
            calls += 1

        await b.serve(GOSSIP_PROTOCOL, handler)
        for _ in range(5):
            with pytest.raises(ConnectionError, match="dropped"):
                await a.open_stream("b", GOSSIP_PROTOCOL)
        await asyncio.sleep(0.01)
        assert calls == 0

    run(main)


def test_kill_ends_the_other_sides_read_and_fails_new_opens() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        a, b = net.transport("a"), net.transport("b")
        handler_cancelled = asyncio.Event()

        async def greet_then_wait(stream: Stream) -> None:
            await stream.write(b"hi")
            try:
                await stream.read_exactly(1)
            except asyncio.CancelledError:
                handler_cancelled.set()
                raise

        await b.serve(GOSSIP_PROTOCOL, greet_then_wait)
        stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        assert await stream.read_exactly(2) == b"hi"
        pending = asyncio.create_task(stream.read_exactly(1))
        await asyncio.sleep(0.01)
        assert not pending.done()

        await net.kill("b")

        with pytest.raises(StreamClosed):
            await pending
        with pytest.raises(StreamClosed):
            await stream.write(b"x")
        assert handler_cancelled.is_set()
        with pytest.raises(ConnectionError, match="'b' is down"):
            await a.open_stream("b", GOSSIP_PROTOCOL)

    run(main)


def test_kill_loses_bytes_in_flight_but_graceful_close_delivers_them() -> None:
    async def exchange(graceful: bool) -> bytes | None:
        net = InMemoryNetwork(LinkModel(latency_s=0.1))
        a, b = net.transport("a"), net.transport("b")
        written = asyncio.Event()

        async def answer(stream: Stream) -> None:
            await stream.write(b"late")
            written.set()
            await asyncio.sleep(10)

        await b.serve(GOSSIP_PROTOCOL, answer)
        stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        await written.wait()  # "late" is now in flight for 0.1 s
        if graceful:
            await b.close()
        else:
            await net.kill("b")
        try:
            return await stream.read_exactly(4)
        except StreamClosed:
            return None
        finally:
            await a.close()

    async def main() -> None:
        assert await exchange(graceful=True) == b"late"
        assert await exchange(graceful=False) is None

    run(main)


def test_closing_a_transport_ends_the_other_sides_pending_read() -> None:
    async def main() -> None:
        net = InMemoryNetwork(LinkModel(latency_s=0.02))
        a, b = net.transport("a"), net.transport("b")
        handler_read: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def wait_for_request(stream: Stream) -> None:
            try:
                await stream.read_exactly(4)
            except StreamClosed as error:
                handler_read.set_result(error)

        await b.serve(GOSSIP_PROTOCOL, wait_for_request)
        await a.open_stream("b", GOSSIP_PROTOCOL)
        await asyncio.sleep(0.05)  # the handler is now blocked in read_exactly

        await a.close()

        assert isinstance(await handler_read, StreamClosed)
        with pytest.raises(ConnectionError, match="transport of peer 'a' is closed"):
            await a.open_stream("b", GOSSIP_PROTOCOL)
        await b.close()

    run(main)


def test_stream_closes_when_its_handler_returns_or_fails() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        a, b = net.transport("a"), net.transport("b")

        async def reply_and_return(stream: Stream) -> None:
            await stream.write(b"ok")

        async def fail(stream: Stream) -> None:
            raise RuntimeError("handler bug")

        await b.serve("/reply", reply_and_return)
        await b.serve("/fail", fail)
        replied = await a.open_stream("b", "/reply")
        assert await replied.read_exactly(2) == b"ok"
        with pytest.raises(StreamClosed, match="after 0 of 1 bytes"):
            await replied.read_exactly(1)
        failed = await a.open_stream("b", "/fail")
        with pytest.raises(StreamClosed):
            await failed.read_exactly(1)
        assert b.handler_errors == 1

    run(main)


def test_freeze_makes_reader_time_out_until_thawed() -> None:
    async def main() -> None:
        net = InMemoryNetwork(LinkModel(latency_s=0.05))
        a, b = net.transport("a"), net.transport("b")
        requests: list[bytes] = []

        async def record_and_answer(stream: Stream) -> None:
            requests.append(await stream.read_exactly(4))
            await stream.write(requests[-1].upper())

        await b.serve(GOSSIP_PROTOCOL, record_and_answer)
        stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        await stream.write(b"ping")  # in flight when b stops: it arrives, but b cannot read it
        net.freeze("b")

        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await stream.read_exactly(4)
        assert requests == []
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await a.open_stream("b", GOSSIP_PROTOCOL)

        net.thaw("b")
        async with asyncio.timeout(2):
            assert await stream.read_exactly(4) == b"PING"
            await (await a.open_stream("b", GOSSIP_PROTOCOL)).close()
        await a.close()
        await b.close()

    run(main)


def test_bytes_sent_before_a_freeze_can_still_be_read() -> None:
    async def main() -> None:
        net = InMemoryNetwork(LinkModel(latency_s=0.05))
        a, b = net.transport("a"), net.transport("b")
        written = asyncio.Event()

        async def greet(stream: Stream) -> None:
            await stream.write(b"hi")
            written.set()
            await stream.read_exactly(1)

        await b.serve(GOSSIP_PROTOCOL, greet)
        stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        await written.wait()
        net.freeze("b")

        async with asyncio.timeout(2):
            assert await stream.read_exactly(2) == b"hi"
        net.thaw("b")
        await a.close()
        await b.close()

    run(main)


def test_writes_to_a_frozen_peer_hang_and_kill_releases_them() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        a, b = net.transport("a"), net.transport("b")
        await b.serve(GOSSIP_PROTOCOL, echo_upper)
        stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        net.freeze("b")

        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await stream.write(b"\x01x")
        pending = asyncio.create_task(stream.read_exactly(1))
        await asyncio.sleep(0.01)
        await net.kill("b")

        with pytest.raises(StreamClosed):
            await pending

    run(main)


def test_byte_counters_are_exact() -> None:
    async def main() -> None:
        net = InMemoryNetwork(LinkModel(latency_s=0.01, bandwidth_bytes_per_s=10_000_000))
        a, b, c = net.transport("a"), net.transport("b"), net.transport("c")
        done = asyncio.Event()

        async def take_1000_reply_17(stream: Stream) -> None:
            await stream.read_exactly(1000)
            await stream.write(bytes(17))
            done.set()

        await b.serve(GOSSIP_PROTOCOL, take_1000_reply_17)
        stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        await stream.write(bytes(600))
        await stream.write(memoryview(bytes(300)))
        await stream.write(b"")
        await stream.write(bytearray(100))
        assert await stream.read_exactly(17) == bytes(17)
        await done.wait()

        assert (a.bytes_sent, a.bytes_received) == (1000, 17)
        assert (b.bytes_sent, b.bytes_received) == (17, 1000)
        assert (c.bytes_sent, c.bytes_received) == (0, 0)

    run(main)


def test_unknown_peer_unserved_protocol_and_self_dial_are_connection_errors() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        a, b = net.transport("a"), net.transport("b")
        await b.serve(GOSSIP_PROTOCOL, echo_upper)

        with pytest.raises(ConnectionError, match="unknown peer 'zed'"):
            await a.open_stream("zed", GOSSIP_PROTOCOL)
        with pytest.raises(ConnectionError, match="'b' does not serve protocol '/other/1'"):
            await a.open_stream("b", "/other/1")
        with pytest.raises(ConnectionError, match="to itself"):
            await a.open_stream("a", GOSSIP_PROTOCOL)
        with pytest.raises(ValueError, match="already serves"):
            await b.serve(GOSSIP_PROTOCOL, echo_upper)

    run(main)


def test_peer_id_can_rejoin_after_it_was_killed() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        a = net.transport("a")
        net.transport("b")
        with pytest.raises(ValueError, match="already has a live transport"):
            net.transport("b")
        await net.kill("b")

        reborn = net.transport("b")
        await reborn.serve(GOSSIP_PROTOCOL, echo_upper)
        stream = await a.open_stream("b", GOSSIP_PROTOCOL)
        await stream.write(b"\x02ok")
        assert await stream.read_exactly(2) == b"OK"
        await a.close()
        await reborn.close()

    run(main)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"latency_s": -0.1}, "latency_s must be finite and >= 0"),
        ({"latency_s": float("inf")}, "latency_s must be finite and >= 0"),
        ({"bandwidth_bytes_per_s": 0}, "bandwidth_bytes_per_s must be > 0"),
        ({"loss": 1.5}, r"loss must be a probability in \[0, 1\]"),
    ],
)
def test_invalid_link_models_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkModel(**kwargs)
