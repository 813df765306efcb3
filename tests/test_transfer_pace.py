"""Whole-model transfers are cut when they stall or fall below the goodput floor, not when they are slow
(gossip.pace): a joiner's download over a slow but moving link finishes past the one deadline it used to
have, a donor that sends the header and then nothing is cut within the stall timeout, and one that moves
too slowly is cut within the bound its size fixes. Over the in-memory transport, whose links are shaped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.memory import InMemoryNetwork, LinkModel
from gossip.pace import TransferPace, TransferProgress, TransferStalled
from gossip.plan import Algorithm, LinkSpec, PlanConfig, make_plan, specs_for_vectors
from gossip.transport import GOSSIP_PROTOCOL, Stream
from gossip.wire import encode_message
from gossip.wire.frames import PREFIX_BYTES, read_prefix
from node.cli.status import format_status
from node.swarm.joining import DownloadWatch
from topology import TopologySpec

pytestmark = pytest.mark.unit

MB = 1_000_000
TENSORS = {"w": np.arange(1_000_000, dtype=np.float32), "b": np.ones(3, np.float32)}  # 4 MB on the wire
PAYLOAD = sum(t.nbytes for t in TENSORS.values())
EXCHANGE_TIMEOUT_S = 0.2  # a download used to get 4 of these (0.8 s), whatever its size


def settings(pace: TransferPace) -> ExchangeSettings:
    return ExchangeSettings(swarm="t", config_hash="h", codec=get_codec("fp32"),
                            exchange_timeout_s=EXCHANGE_TIMEOUT_S, pace=pace)


async def donor(net: InMemoryNetwork, pace: TransferPace = TransferPace()) -> GossipPeer:
    peer = GossipPeer(net.transport("donor"), settings(pace), TENSORS, step=9)
    await peer.start()
    peer.park()
    return peer


def joiner(net: InMemoryNetwork, pace: TransferPace) -> GossipPeer:
    return GossipPeer(net.transport("joiner"), settings(pace), {n: np.zeros_like(t) for n, t in TENSORS.items()})


def test_a_slow_but_moving_download_finishes_past_its_old_whole_deadline() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        net.set_link("donor", "joiner", LinkModel(bandwidth_bytes_per_s=2 * MB))  # 2 s for the model
        await donor(net)
        me = joiner(net, TransferPace(stall_timeout_s=1.5, goodput_floor_mbit_s=2.0))
        watch = DownloadWatch()
        seen = []

        async def look() -> None:
            while True:
                await asyncio.sleep(0.3)
                seen.append(watch.snapshot())

        looking = asyncio.create_task(look())
        started = time.monotonic()
        try:
            tensors, _, step = await me.fetch("donor", watch.start("donor"))
        finally:
            looking.cancel()
        elapsed = time.monotonic() - started
        assert elapsed > 4 * EXCHANGE_TIMEOUT_S  # the old whole deadline would have cut it
        assert step == 9 and all(np.array_equal(tensors[n], t) for n, t in TENSORS.items())
        # the progress moved while it ran, towards the payload's size, with a rate and an ETA
        during = [p for p in seen if p is not None]
        assert during and all(p.bytes_total == PAYLOAD and p.donors == ("donor",) for p in during)
        assert any(0 < p.bytes_done < PAYLOAD and p.rate_bps > 0 and p.eta_s is not None for p in during)

    asyncio.run(main())


def reply_bytes(sender: str) -> tuple[bytes, bytes]:
    """A valid reply carrying TENSORS from `sender`: its header (with the prefix) and its payload frames."""
    message = b"".join(bytes(b) for b in encode_message(
        TENSORS, get_codec("fp32"), swarm="t", config_hash="h", sender=sender, round=0, step=9, kind="reply"))
    header_end = PREFIX_BYTES + read_prefix(message[:PREFIX_BYTES])
    return message[:header_end], message[header_end:]


def hostile_answer(sender: str, then: float | None, *, piece: int | None = None) -> Callable[[Stream], Awaitable[None]]:
    """A donor's answer to any request: a valid reply header for the joiner's model, then nothing (`then`
    None) or the payload at `then` bytes per second, written `piece` bytes at a time with a pause after
    each (the sender throttled), or frame by frame (`piece` None: a shaped link paces the writes)."""
    header, payload = reply_bytes(sender)

    async def answer(stream: Stream) -> None:
        await stream.write(header)
        if then is not None:
            at = 0
            while at < len(payload):
                size = piece or PREFIX_BYTES + read_prefix(payload[at:at + PREFIX_BYTES])
                await stream.write(payload[at:at + size])
                at += size
                if piece:
                    await asyncio.sleep(size / then)
        await asyncio.sleep(3600)

    return answer


async def hostile(net: InMemoryNetwork, then: float | None) -> None:
    """The hostile donor "donor" on the in-memory network, its link to the joiner shaped to `then` bytes/s."""
    transport = net.transport("donor")
    await transport.serve(GOSSIP_PROTOCOL, hostile_answer("donor", then))
    if then is not None:
        net.set_link("donor", "joiner", LinkModel(bandwidth_bytes_per_s=then))


def test_a_donor_that_sends_the_header_and_then_nothing_is_cut_within_the_stall_timeout() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        await hostile(net, then=None)
        stall = 1.0
        me = joiner(net, TransferPace(stall_timeout_s=stall, goodput_floor_mbit_s=0.5))  # whole bound: 65 s
        progress = TransferProgress()
        started = time.monotonic()
        with pytest.raises(TransferStalled, match="nothing moved"):
            await me.fetch("donor", progress)
        elapsed = time.monotonic() - started
        assert stall <= elapsed < stall + 2.0
        assert progress.bytes_total == PAYLOAD and progress.bytes_done == 0

    asyncio.run(main())


def test_a_donor_below_the_goodput_floor_is_cut_by_the_bound_its_size_fixes() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        # 1 MB/s: every 1 MiB frame arrives within the stall timeout, but the whole needs 4 s
        await hostile(net, then=1 * MB)
        pace = TransferPace(stall_timeout_s=1.5, goodput_floor_mbit_s=16.0)  # 16 Mbit/s = 2 MB/s
        bound = pace.whole_s(PAYLOAD)
        assert bound == pytest.approx(1.5 + 2.0, rel=0.01)
        me = joiner(net, pace)
        started = time.monotonic()
        with pytest.raises(TimeoutError) as cut:
            await me.fetch("donor")
        elapsed = time.monotonic() - started
        assert not isinstance(cut.value, TransferStalled)  # it moved: the size bound cut it
        assert bound - 0.1 <= elapsed < bound + 2.0

    asyncio.run(main())


def test_the_whole_bound_follows_the_measured_goodput_within_its_slack_and_never_below_the_floor() -> None:
    pace = TransferPace(stall_timeout_s=20.0, goodput_floor_mbit_s=2.0)
    size = 400 * MB  # a 100M-parameter model in fp32
    assert pace.whole_s(size) == pytest.approx(20 + 1600)  # no measurement: the floor
    assert pace.whole_s(size, 400.0) == pytest.approx(20 + 32)  # measured 400 Mbit/s: 4 x slower still fits
    assert pace.whole_s(size, 1.0) == pace.whole_s(size)  # a measurement below the floor is the floor


def test_murmur_plan_predicts_a_joiners_download_in_fp32_whatever_the_codec_and_its_bound() -> None:
    specs = specs_for_vectors({"w": 100_000_000})  # a 100M-parameter model
    link = LinkSpec(50.0)

    def download(**kw: object):
        return make_plan(PlanConfig(specs, 1.0, link, 4, TopologySpec("ring"), **kw)).download

    fp32 = download()
    assert 400 * MB <= fp32.nbytes < 400 * MB + 10_000
    assert fp32.seconds == pytest.approx(fp32.nbytes / link.bytes_per_s, rel=1e-3)  # about 69 s at 50 Mbit/s
    assert fp32.bound_s == pytest.approx(TransferPace().whole_s(fp32.nbytes)) and fp32.bound_s > 20 * fp32.seconds
    # a donor serves the exact parameters in fp32 whatever codec the rounds use, for every algorithm
    assert download(codec=get_codec("int8")).nbytes == fp32.nbytes
    assert download(codec=get_codec("int8"), algorithm=Algorithm.DILOCO).nbytes == fp32.nbytes


def test_murmur_status_shows_a_running_download_and_nothing_once_it_is_over() -> None:
    status = {"peer_id": "me", "swarm": "s", "maddrs": [], "round": 0, "step": 0, "peers": [], "bytes_sent": 0,
              "bytes_received": 0, "errors": {}, "training": {"step": 0}, "loss": None, "val_loss": None,
              "join": {"bytes_done": 120_000_000, "bytes_total": 400_000_000, "rate_bps": 2_000_000.0, "eta_s": 140.0,
                       "donors": ["donor-a"]}}
    lines = format_status(status).splitlines()
    assert "download 120.0 / 400.0 MB (30%) at 2.00 MB/s, 2 min 20 s left from donor-a" in lines
    assert not any(line.startswith("download") for line in format_status({**status, "join": None}).splitlines())
