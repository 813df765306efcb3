"""A hostile peer on its own p2pd sends bad `/murmur/gossip/1` requests to a real node process: before it
has a record in the swarm its streams are closed unread (`not_member`); once it has one, each bad
request is refused with its specific error counted in the node's status; and the honest nodes' vectors
are exactly what honest gossip alone makes of them."""

import asyncio
import contextlib

import numpy as np
import pytest

from gossip.codecs import get_codec
from gossip.errors import WIRE_ERROR_KINDS
from gossip.transport import GOSSIP_PROTOCOL
from gossip.wire import encode_message
from support.hostile_flood import join_open_swarm, read_answer
from support.swarm_harness import Node, Swarm, initial_vector, mean_vector, wait_for

pytestmark = pytest.mark.multiprocess

DIM = 64
# (what the attacker sends, the error kind the victim must count for it). An exchange request with NaN
# values or cut halfway is refused on its header (no round waits for this peer: its round is stale)
# before a byte of its tensors is read: counted as a refused request, not a wire error.
ATTACKS = [
    ("garbage", "too_large"),  # 0xff... read as a frame length of 2^64 - 1
    ("reply_as_request", "bad_schema"),
    ("wrong_manifest", "manifest_mismatch"),
    ("nan", "refused: stale"),
    ("other_swarm_config", "wrong_swarm"),
    ("half_then_hang_up", "refused: stale"),
]


def bad_frames(case: str, *, swarm: str, config_hash: str, sender: str) -> list[bytes]:
    huge = {"params": np.full(DIM, 1e3, np.float32)}  # would show in the victim's vector if it got through
    common = dict(swarm=swarm, config_hash=config_hash, sender=sender, round=1, step=0)
    fp32 = get_codec("fp32")
    if case == "garbage":
        return [b"\xff" * 64]
    if case == "reply_as_request":
        return encode_message(huge, fp32, **common, kind="reply")
    if case == "wrong_manifest":
        return encode_message({"params": np.ones(DIM + 1, np.float32)}, fp32, **common, kind="exchange")
    if case == "nan":
        body = bytearray(b"".join(bytes(f) for f in encode_message(huge, fp32, **common, kind="exchange")))
        body[-4:] = np.array([np.nan], np.float32).tobytes()
        return [bytes(body)]
    if case == "other_swarm_config":
        return encode_message(huge, fp32, **{**common, "config_hash": "0" * 64}, kind="exchange")
    whole = b"".join(bytes(f) for f in encode_message(huge, fp32, **common, kind="exchange"))
    return [whole[: len(whole) // 2]]


# the attacks counted as wire errors (the others as refused requests)
WIRE_ATTACKS = [kind for _, kind in ATTACKS if not kind.startswith("refused")]


def wire_errors(node: Node) -> dict[str, int]:
    errors = node.status()["errors"]
    return {kind: errors[kind] for kind in WIRE_ERROR_KINDS if kind in errors}


async def attack(victim: Node, identity_path, swarm_name: str, config_hash: str,
                 dht_maddrs: tuple[str, ...] | None = None) -> None:
    """`dht_maddrs`: where the victim's DHT listens, if not at `victim.maddrs` (a py-libp2p data plane)."""
    # hivemind is imported here, not at collection, so `pytest -m unit` does not pay for it
    from node.net.identity import create_identity
    from node.net.transport.p2pd import P2PDTransport, P2PSettings, start_p2pd

    identity = create_identity(identity_path)
    dht = dht_maddrs or victim.maddrs
    p2p = await start_p2pd(P2PSettings(identity_path=identity_path, initial_peers=dht, nat_port_map=False))
    transport = P2PDTransport(p2p)
    discovery = None
    try:
        await transport.connect(victim.peer_id, victim.maddrs)
        # no record yet: the stream is closed before a byte of it is read
        stream = await transport.open_stream(victim.peer_id, GOSSIP_PROTOCOL)
        with contextlib.suppress(ConnectionError):  # it may be closed before the write
            await stream.write(bad_frames("garbage", swarm=swarm_name, config_hash=config_hash,
                                          sender=identity.peer_id)[0])
        await asyncio.to_thread(wait_for, lambda: victim.status()["limits"]["streams_refused"].get("not_member"), 10,
                                "a stream from a peer without a record refused")
        await stream.close()
        assert wire_errors(victim) == {}
        discovery = await join_open_swarm(p2p, identity, swarm_name, dht, heartbeat_s=2)
        await asyncio.to_thread(wait_for, lambda: any(p["peer_id"] == identity.peer_id for p in victim.status()["peers"]),
                                20, "the attacker's record in the victim's view")
        stale_before = victim.status()["limits"]["requests_refused"].get("stale", 0)

        def counted() -> tuple[dict[str, int], int]:
            return wire_errors(victim), victim.status()["limits"]["requests_refused"].get("stale", 0) - stale_before

        # The honest node's requests are refused as stale too when it lags (a loaded machine): stale
        # refusals are told apart by the reject this peer gets back, and the victim's count must cover them.
        wire_expected: dict[str, int] = {}
        stale_expected = 0
        for case, kind in ATTACKS:
            frames = bad_frames(case, swarm=swarm_name, config_hash=config_hash, sender=transport.peer_id)
            stream = await transport.open_stream(victim.peer_id, GOSSIP_PROTOCOL)
            answer = None
            async with asyncio.timeout(10):
                with contextlib.suppress(ConnectionError):  # refused on its header: the rest is not read
                    for frame in frames:
                        await stream.write(frame)
                if kind.startswith("refused"):
                    answer, _ = await read_answer(stream)
                await stream.close()  # end of stream: the half message stays half
            if kind.startswith("refused"):
                assert answer == kind.removeprefix("refused: "), (case, answer)
                stale_expected += 1
            else:
                wire_expected[kind] = wire_expected.get(kind, 0) + 1
            try:
                await asyncio.to_thread(
                    wait_for, lambda: (c := counted())[0] == wire_expected and c[1] >= stale_expected, 10,
                    f"{case} counted as {kind}")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: counted {counted()}, expected {wire_expected} and "
                                     f"{stale_expected} stale; streams refused "
                                     f"{victim.status()['limits']['streams_refused']}") from None
    finally:
        if discovery is not None:
            await discovery.close()
        await transport.close()
        await p2p.shutdown()


def test_bad_requests_are_refused_by_kind_and_honest_vectors_stay_exact(tmp_path):
    with Swarm(tmp_path, dim=DIM, round_interval=0.4, heartbeat=2) as swarm:
        victim, honest = swarm.start(2, min_peers=2)
        swarm.wait_rounds([victim, honest], 2, timeout_s=60)
        status = victim.status()
        asyncio.run(attack(victim, tmp_path / "attacker.key", status["swarm"], status["config_hash"]))

        assert wire_errors(honest) == {}
        ran = victim.status()["rounds_run"]
        wait_for(lambda: victim.status()["rounds_run"] >= ran + 2, 30, "the victim to keep gossiping")
        assert swarm.stop_all([victim, honest]) == [0, 0], swarm.logs()

    # two honest nodes pull each other's vectors: each round both hold exactly the mean of the two
    a, b = victim.checkpoint()[0], honest.checkpoint()[0]
    np.testing.assert_array_equal(a, b)
    expected = mean_vector([initial_vector(victim.seed, DIM), initial_vector(honest.seed, DIM)])
    np.testing.assert_allclose(a, expected, rtol=0, atol=1e-6)
