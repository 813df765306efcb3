"""A round's exchanges are paced by their payload, not cut at one fixed deadline (gossip.pace, docs/training.md
"Transfers"): over a slow but moving link a round whose payload takes several exchange deadlines completes and
mixes, on the asking and the serving side; a neighbour that sends its reply's header and then nothing is cut
within the stall timeout. Over the in-memory transport, whose links are shaped."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
from test_transfer_pace import TENSORS, hostile_answer

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.memory import InMemoryNetwork, LinkModel
from gossip.pace import TransferPace
from gossip.plan import Algorithm, Compression, LinkSpec, PlanConfig, gossip_estimate, specs_for_vectors
from gossip.transport import GOSSIP_PROTOCOL
from gossip.wire import message_nbytes
from topology import PeerRound, TopologySpec

pytestmark = pytest.mark.unit

MB = 1_000_000
EXCHANGE_TIMEOUT_S = 0.4
PACE = TransferPace(stall_timeout_s=1.0, goodput_floor_mbit_s=2.0)
SIZE = 300_000  # float32 elements: 1.2 MB a message


def settings(exchange_timeout_s: float = EXCHANGE_TIMEOUT_S) -> ExchangeSettings:
    return ExchangeSettings(swarm="t", config_hash="h", codec=get_codec("fp32"), exchange_timeout_s=exchange_timeout_s,
                            pace=PACE)


def pair(net: InMemoryNetwork, a_timeout_s: float = EXCHANGE_TIMEOUT_S,
         b_timeout_s: float = EXCHANGE_TIMEOUT_S) -> tuple[GossipPeer, GossipPeer]:
    a = GossipPeer(net.transport("a"), settings(a_timeout_s), {"w": np.zeros(SIZE, np.float32)})
    b = GossipPeer(net.transport("b"), settings(b_timeout_s), {"w": np.full(SIZE, 2.0, np.float32)})
    return a, b


@pytest.mark.parametrize("kind", ["exchange", "pull"])
def test_a_round_whose_payload_takes_three_exchange_deadlines_over_a_slow_link_completes_and_mixes(kind: str) -> None:
    async def main() -> None:
        nbytes = message_nbytes({"w": np.zeros(SIZE, np.float32)}, get_codec("fp32"))
        # the payload crosses the link in 3 exchange deadlines (an exchange's request and reply at once: duplex)
        rate = nbytes / (3 * EXCHANGE_TIMEOUT_S)
        net = InMemoryNetwork(LinkModel(bandwidth_bytes_per_s=rate))
        a, b = pair(net)
        for peer in (a, b):
            await peer.start()
        if kind == "exchange":  # a symmetric edge: "a" asks, "b" awaits its request
            out_a, out_b = await asyncio.gather(a.run_round(0, PeerRound(0.5, {"b": 0.5}, ("b",))),
                                                b.run_round(0, PeerRound(0.5, {"a": 0.5}, ("a",))))
            assert out_b.mixed_with == ("a",), out_b.skipped
            np.testing.assert_allclose(b.tensors["w"], 1.0)
        else:  # a directed edge b -> a: "a" pulls, "b" serves
            await b.run_round(0, PeerRound(1.0, {}, ("a",)))
            out_a = await a.run_round(0, PeerRound(0.5, {"b": 0.5}, ()))
        assert out_a.mixed_with == ("b",), out_a.skipped
        assert out_a.duration_s > 2 * EXCHANGE_TIMEOUT_S  # the fixed deadline would have cut it
        np.testing.assert_allclose(a.tensors["w"], 1.0)
        assert a.stats.errors == {} and b.stats.errors == {} and b.stats.exchanges_ok == 1

    asyncio.run(main())


def test_the_serving_side_does_not_cut_a_slow_askers_reply_at_its_exchange_deadline() -> None:
    """b's exchange deadline is a tenth of the time its reply takes to reach a over their link; b must
    send all of it (paced by its size), not cut it at the deadline and leave a, which waits long enough
    (its own deadline alone would do), with a truncated message."""
    async def main() -> None:
        b_timeout_s = 0.15
        net = InMemoryNetwork()
        net.set_link("b", "a", LinkModel(bandwidth_bytes_per_s=0.8 * MB), both_directions=False)  # 1.5 s
        a, b = pair(net, a_timeout_s=10.0, b_timeout_s=b_timeout_s)
        for peer in (a, b):
            await peer.start()
        await b.run_round(0, PeerRound(1.0, {}, ("a",)))
        started = time.monotonic()
        outcome = await a.run_round(0, PeerRound(0.5, {"b": 0.5}, ()))
        assert outcome.mixed_with == ("b",), outcome.skipped
        assert time.monotonic() - started > 5 * b_timeout_s
        assert b.stats.exchanges_ok == 1 and b.stats.errors == {}
        np.testing.assert_allclose(a.tensors["w"], 1.0)

    asyncio.run(main())


def test_a_neighbour_may_take_its_whole_exchange_deadline_to_start_answering_whatever_the_stall_timeout() -> None:
    """The stall timeout applies once the reply's header has fixed its size: before that, b may wait for
    its round to begin for up to a's exchange deadline, longer than the stall timeout here."""
    async def main() -> None:
        net = InMemoryNetwork()
        a = GossipPeer(net.transport("a"), ExchangeSettings(
            swarm="t", config_hash="h", codec=get_codec("fp32"), exchange_timeout_s=5.0,
            pace=TransferPace(stall_timeout_s=0.3)), {"w": np.zeros(SIZE, np.float32)})
        b = GossipPeer(net.transport("b"), settings(5.0), {"w": np.full(SIZE, 2.0, np.float32)})
        for peer in (a, b):
            await peer.start()
        asking = asyncio.create_task(a.run_round(0, PeerRound(0.5, {"b": 0.5}, ())))
        await asyncio.sleep(1.0)  # b begins the round a pulls three stall timeouts late
        await b.run_round(0, PeerRound(1.0, {}, ("a",)))
        outcome = await asking
        assert outcome.mixed_with == ("b",), outcome.skipped
        np.testing.assert_allclose(a.tensors["w"], 1.0)

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["exchange", "pull"])
def test_a_neighbour_that_sends_the_header_and_then_nothing_is_cut_within_the_stall_timeout(kind: str) -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        hostile = net.transport("donor")
        await hostile.serve(GOSSIP_PROTOCOL, hostile_answer("donor", None))  # a valid reply header, then silence
        stall = 1.0
        pace = TransferPace(stall_timeout_s=stall, goodput_floor_mbit_s=0.5)  # whole bound for 4 MB: 65 s
        me = GossipPeer(net.transport("a"), ExchangeSettings(
            swarm="t", config_hash="h", codec=get_codec("fp32"), exchange_timeout_s=0.2, pace=pace),
            {n: np.zeros_like(t) for n, t in TENSORS.items()})
        started = time.monotonic()
        outcome = await me.run_round(0, PeerRound(0.5, {"donor": 0.5}, ("donor",) if kind == "exchange" else ()))
        elapsed = time.monotonic() - started
        assert outcome.skipped == {"donor": "timeout"} and outcome.mixed_with == ()
        assert stall <= elapsed < stall + 3.0
        assert all(np.array_equal(me.tensors[n], np.zeros_like(t)) for n, t in TENSORS.items())

    asyncio.run(main())


def test_murmur_plan_predicts_a_rounds_time_from_its_payload_over_the_link() -> None:
    """A duplex exchange's request and reply cross the link at once: a 100M-parameter int8 model's round at
    50 Mbit/s takes about one of its transfers (~16 s), far past a 5 s deadline; compressed gossip's, which
    answers after the request, two."""
    link = LinkSpec(50.0)
    specs = specs_for_vectors({"w": 100_000_000})
    config = PlanConfig(specs, 1.0, link, 8, TopologySpec("hypercube"), codec=get_codec("int8"))  # one partner a round
    one = link.transfer_s(message_nbytes(specs, get_codec("int8")))
    assert 15.0 < one < 20.0
    assert gossip_estimate(config).sync_s == pytest.approx(one, rel=0.05)
    choco = dataclasses.replace(config, algorithm=Algorithm.DADAM, compression=Compression.CHOCO)
    assert gossip_estimate(choco).sync_s == pytest.approx(2 * one, rel=0.05)


def test_a_spes_expert_fetch_over_a_slow_but_moving_link_is_not_cut_at_the_exchange_deadline() -> None:
    from gossip.spes.fetch import ExpertFetch, ServedCopy
    from gossip.spes.rules import ExpertRecord, codec_image, content_hash

    expert = {"e.w": np.linspace(-1, 1, SIZE, dtype=np.float32)}

    class Owner:
        def holds(self, key: tuple[int, int]) -> bool:
            return key == (0, 1)

        async def served_copy(self, key: tuple[int, int], have: str | None = None) -> ServedCopy:
            image = codec_image(list(expert.values()), "bf16")
            return ServedCopy(dict(zip(expert, image)), ExpertRecord(3, content_hash(image), True))

    async def main() -> float:
        nbytes = message_nbytes(expert, get_codec("bf16"))
        net = InMemoryNetwork(LinkModel(bandwidth_bytes_per_s=nbytes / (3 * EXCHANGE_TIMEOUT_S)))
        owner = ExpertFetch(net.transport("owner"), settings(), "bf16", lambda: 0)
        await owner.serve(Owner())
        asker = ExpertFetch(net.transport("asker"), settings(), "bf16", lambda: 0)
        started = time.monotonic()
        tensors, record = await asker.fetch("owner", (0, 1), expert, min_version=3)
        took = time.monotonic() - started
        assert record.version == 3 and np.allclose(tensors["e.w"], expert["e.w"], atol=1e-2)
        for _ in range(100):  # the owner counts it once its last write returns, which may be after the read
            if owner.stats.served:
                break
            await asyncio.sleep(0.05)
        assert owner.stats.served == 1 and owner.stats.errors == {}
        return took

    assert asyncio.run(main()) > 2 * EXCHANGE_TIMEOUT_S  # the fixed deadline would have cut it


@pytest.mark.parametrize("compressed", [False, True], ids=["dense", "choco"])
def test_a_dense_exchange_reads_the_reply_while_it_writes_the_request(compressed: bool, monkeypatch) -> None:
    """A symmetric exchange over a slow link is duplex (gossip.exchange.DUPLEX): the asker has the whole reply
    before it has finished writing its request, so the pair's round takes one transfer's time, not two.
    Compressed gossip answers only a request it has read and screened: its reply comes after."""
    from gossip import stream as stream_module
    from gossip.choco import ChocoSettings, ChocoState

    events: list[tuple[str, str]] = []  # (what, on which side), in the order they happened
    send, read_header = stream_module.MessageStream.send, stream_module.MessageStream.read_header

    async def recorded_send(self, frames, stall_s=None):
        await send(self, frames, stall_s)
        events.append(("sent", self.remote_peer))

    async def recorded_read_header(self, *args, **kwargs):
        incoming = await read_header(self, *args, **kwargs)
        message = incoming.header.kind
        events.append((f"read {message}", self.remote_peer))
        return incoming

    monkeypatch.setattr(stream_module.MessageStream, "send", recorded_send)
    monkeypatch.setattr(stream_module.MessageStream, "read_header", recorded_read_header)

    async def main() -> None:
        nbytes = message_nbytes({"w": np.zeros(SIZE, np.float32)}, get_codec("fp32"))
        net = InMemoryNetwork(LinkModel(bandwidth_bytes_per_s=nbytes / (3 * EXCHANGE_TIMEOUT_S)))
        values = {"a": 0.0, "b": 2.0}

        def choco() -> ChocoState | None:
            return ChocoState(ChocoSettings(get_codec("fp32"), 0.5), {"w": np.zeros(SIZE, np.float32)}) if compressed else None

        a, b = (GossipPeer(net.transport(p), settings(), {"w": np.full(SIZE, v, np.float32)}, choco=choco())
                for p, v in values.items())
        for peer in (a, b):
            await peer.start()
        out_a, out_b = await asyncio.gather(a.run_round(0, PeerRound(0.5, {"b": 0.5}, ("b",))),
                                            b.run_round(0, PeerRound(0.5, {"a": 0.5}, ("a",))))
        assert out_a.mixed_with == ("b",) and out_b.mixed_with == ("a",), (out_a.skipped, out_b.skipped)
        on_a = [what for what, remote in events if remote == "b"]  # the asker's stream to b
        request_sent, reply_read = on_a.index("sent"), on_a.index("read reply")
        if compressed:
            assert request_sent < reply_read, on_a
        else:
            assert reply_read < request_sent, on_a

    asyncio.run(main())


def test_a_message_cut_partway_is_followed_by_nothing_not_even_a_reject() -> None:
    """A duplex answer that is cut (its request turned out bad, or the round ended) must not be followed by a
    reject: the asker would read the reject's bytes as the rest of the answer. The stream says a message of
    its own was cut, and `try_reject` then writes nothing; the other end reads a truncated message."""
    import logging

    from gossip.errors import Truncated
    from gossip.exchange import REJECT, ExchangeStats
    from gossip.stream import Accounting, MessageStream
    from gossip.wire import DEFAULT_LIMITS, iter_message

    def accounting() -> Accounting:
        return Accounting(ExchangeStats(), logging.getLogger("test"), "refused")

    async def main() -> None:
        net = InMemoryNetwork(LinkModel(bandwidth_bytes_per_s=1_000_000))
        sender, receiver = net.transport("s"), net.transport("r")
        arrived: asyncio.Queue = asyncio.Queue()

        async def handler(raw) -> None:
            stream = MessageStream(raw, accounting())
            try:
                await arrived.put(await stream.read(DEFAULT_LIMITS, None))
            except Truncated as exc:
                await arrived.put(exc)

        await receiver.serve("/t/1", handler)
        stream = MessageStream(await sender.open_stream("r", "/t/1"), accounting())
        frames = iter_message({"w": np.ones(SIZE, np.float32)}, get_codec("fp32"), swarm="t", config_hash="h",
                              sender="s", round=0, step=0, kind="reply")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):  # 1.2 MB at 1 MB/s: cut partway
                await stream.send(frames)
        assert stream.mid_message
        reject = iter_message({}, get_codec("fp32"), swarm="t", config_hash="h", sender="s", round=0, step=0,
                              kind=REJECT)
        cut_at = sender.bytes_sent
        await stream.try_reject(lambda: reject, 1.0)
        assert sender.bytes_sent == cut_at  # nothing written after the cut message
        await stream.close()
        got = await asyncio.wait_for(arrived.get(), 10)
        assert isinstance(got, Truncated), got

    asyncio.run(main())


def test_a_donor_uploads_its_model_to_a_few_at_once_and_the_others_ask_again_or_go_elsewhere() -> None:
    """Pulls of the current parameters (a joiner's download, a final merge) are served
    IncomingLimits.concurrent_uploads at a time: a pull beyond is refused `uploading` at once. A joiner's
    fetch (no busy wait) takes that as a refusal and moves on; a final merge's (busy_wait_s) asks again
    and is served once the donor has room."""
    from gossip.exchange import PeerRejected, Refusal
    from gossip.limits import IncomingLimits

    async def main() -> None:
        nbytes = message_nbytes({"w": np.zeros(SIZE, np.float32)}, get_codec("fp32"))
        net = InMemoryNetwork(LinkModel(bandwidth_bytes_per_s=nbytes / 1.0))  # an upload takes about 1 s
        one_at_a_time = dataclasses.replace(settings(), incoming=IncomingLimits(concurrent_uploads=1))
        donor = GossipPeer(net.transport("donor"), one_at_a_time, {"w": np.full(SIZE, 3.0, np.float32)})
        askers = [GossipPeer(net.transport(p), settings(), {"w": np.zeros(SIZE, np.float32)}) for p in ("a", "b", "c")]
        for peer in (donor, *askers):
            await peer.start()
        first = asyncio.create_task(askers[0].fetch("donor"))
        await asyncio.sleep(0.3)  # the first upload is under way
        with pytest.raises(PeerRejected, match=str(Refusal.UPLOADING)):
            await askers[1].fetch("donor")  # a joiner: refused at once, takes another donor
        patient = await askers[2].fetch("donor", busy_wait_s=askers[2].busy_wait_s(3))
        tensors, _, _ = await first
        assert all(np.array_equal(t["w"], np.full(SIZE, 3.0, np.float32)) for t in (tensors, patient[0]))
        assert donor.stats.refused[str(Refusal.UPLOADING)] >= 2  # b's, and c's until a's upload ended

    asyncio.run(main())


def test_a_duplex_exchange_cancelled_from_outside_is_cancelled_whatever_its_halves_raise() -> None:
    """A stop or a timeout cancels a round in the middle of a duplex exchange: the half that is cancelled
    aborts the stream, and the other half then fails with a ConnectionError before its own cancel lands. The
    exchange must end cancelled, not as that ConnectionError (a skip the round would carry on after: the
    stop would be lost and the node would not end)."""
    from gossip.exchange import _both

    async def main() -> None:
        aborted = asyncio.Event()

        async def writing() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                aborted.set()  # a cancelled write aborts the stream (node.net.transport.p2pd.P2PDStream)

        async def reading() -> None:
            await aborted.wait()
            raise ConnectionError("the stream was aborted")

        task = asyncio.create_task(_both(writing(), reading()))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # a half that fails on its own is raised as itself
        async def failing() -> None:
            raise ConnectionError("gone")

        with pytest.raises(ConnectionError, match="gone"):
            await _both(failing(), asyncio.sleep(3600))
        # and an outer timeout still reads as one
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                aborted.clear()
                await _both(writing(), reading())

    asyncio.run(main())
