"""Relay slots against a stranger that mints identities: what murmur's p2pd relay service gives away.

A p2pd relay started as a `murmur bootstrap` starts its service (murmur's flags, its limits checked in
force), on loopback. In order, each its own process (py-libp2p identities, as a node behind NAT reserves
with `--transport libp2p`):

1. a holder reserves a slot (a member behind NAT that is already there);
2. a newcomer reserves and leaves (the control: the relay gives slots);
3. a stranger mints `--identities` identities, each reserving a slot from the same address, holds them
   a few seconds and exits;
4. a newcomer asks for a slot after the stranger has gone, and the holder refreshes its own.

Printed: the slots the stranger got, whether each newcomer got one, whether the holder's refresh was
accepted. No root needed. Figures and what they mean: docs/threat-model.md ("Relay slots").

Run from the repository root: .venv/bin/python -m bench.bench_relay_slots [--identities 140]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROLE_TIMEOUT_S = 120.0
HOLD_S = 5.0  # how long the stranger keeps its connections open before it exits


def reservations(relay: str, count: int, hold_s: float, refresh_after: Path | None) -> dict:
    """`count` fresh identities each ask `relay` for a slot at once; with `refresh_after`, the first one
    asks again once that file exists. py-libp2p (trio) only: this process never imports hivemind."""
    import multiaddr
    import trio
    from libp2p.crypto.secp256k1 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP

    from node.net.transport.libp2p_child import ChildSettings, Relaying, make_host

    relay_id = ID.from_base58(relay.rsplit("/p2p/", 1)[1])
    address = multiaddr.Multiaddr(relay.rsplit("/p2p/", 1)[0])
    listen = "/ip4/127.0.0.1/tcp/0"
    settings = ChildSettings(0, Path(), "", (listen,), Path(), Path(), 10.0, 10.0)
    granted: list[bool] = []
    refreshed: list[bool] = []

    async def one(first: bool, done: trio.Event) -> None:
        host = make_host(create_new_key_pair(), settings)
        async with host.run(listen_addrs=[multiaddr.Multiaddr(listen)]):
            relaying = Relaying(host, (relay,))
            try:
                with trio.fail_after(30):
                    await host.connect(PeerInfo(relay_id, [address]))
                    stream = await host.new_stream(relay_id, [HOP])
                    granted.append(bool(await relaying.transport._make_reservation(stream, relay_id)))
            except Exception:
                granted.append(False)
            if first and refresh_after is not None:
                with trio.fail_after(ROLE_TIMEOUT_S):
                    while not refresh_after.exists():
                        await trio.sleep(0.2)
                stream = await host.new_stream(relay_id, [HOP])
                refreshed.append(bool(await relaying.transport._make_reservation(stream, relay_id)))
            await done.wait()

    async def main() -> None:
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(one, i == 0, done)
            with trio.move_on_after(ROLE_TIMEOUT_S):
                while len(granted) < count or (refresh_after is not None and not refreshed):
                    await trio.sleep(0.2)
            await trio.sleep(hold_s)
            done.set()

    trio.run(main)
    return {"asked": count, "granted": sum(granted), "refreshed": refreshed[0] if refreshed else None}


def reservations_role(spec: dict) -> None:
    refresh = Path(spec["refresh_after"]) if spec.get("refresh_after") else None
    print(json.dumps(reservations(spec["relay"], spec["count"], spec["hold_s"], refresh)), flush=True)


async def _role(spec: dict) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.bench_relay_slots", "--role", "reserve",
                                                "--spec", json.dumps(spec), cwd=REPO, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL)


async def _answer(process: asyncio.subprocess.Process) -> dict:
    assert process.stdout is not None
    async with asyncio.timeout(ROLE_TIMEOUT_S * 2):
        line = await process.stdout.readline()
        await process.wait()
    return json.loads(line)


async def run(identities: int, workdir: Path) -> dict:
    from node.net.hivemind_adapter import RelayLimits
    from node.net.probe import relay_limits_in_force
    from node.net.transport.p2pd import P2PSettings, start_p2pd
    from node.runtime.host import RELAY_SERVICE_ATTEMPTS

    limits = RelayLimits(8192 << 20, 3600)  # a bootstrap's defaults
    settings = P2PSettings(identity_path=None, relay_service=limits)

    async def restart(old):
        await old.shutdown()
        return await start_p2pd(settings)

    relay, check = await relay_limits_in_force(await start_p2pd(settings), restart, RELAY_SERVICE_ATTEMPTS)
    try:
        maddr = next(str(m) for m in await relay.get_visible_maddrs())
        signal = workdir / "refresh"
        holder = await _role({"relay": maddr, "count": 1, "hold_s": 0, "refresh_after": str(signal)})
        before = await _answer(await _role({"relay": maddr, "count": 1, "hold_s": 0}))
        stranger = await _answer(await _role({"relay": maddr, "count": identities, "hold_s": HOLD_S}))
        after = await _answer(await _role({"relay": maddr, "count": 1, "hold_s": 0}))
        signal.touch()
        held = await _answer(holder)
    finally:
        await relay.shutdown()
    return {"relay_check": str(check.verdict), "max_reservations": limits.max_reservations,
            "newcomer_before": before["granted"] == 1, "stranger": stranger, "newcomer_after": after["granted"] == 1,
            "holder": held["granted"] == 1, "holder_refresh": held["refreshed"]}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_relay_slots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--identities", type=int, default=140, help="identities the stranger mints (default 140)")
    parser.add_argument("--role", choices=("reserve",), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "reserve":
        reservations_role(json.loads(args.spec))
        return
    if not 1 <= args.identities <= 1024:
        parser.error("--identities must be in [1, 1024]")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="murmur-relay-slots-") as tmp:
        result = asyncio.run(run(args.identities, Path(tmp)))
    stranger = result["stranger"]
    print(f"command: .venv/bin/python -m bench.bench_relay_slots --identities {args.identities}")
    print(f"relay: p2pd with murmur's relay service ({result['relay_check']}), -relayMaxReservations "
          f"{result['max_reservations']}\n")
    print("| who | asked | got |\n|---|---:|---|")
    print(f"| a newcomer, before (control) | 1 | {'yes' if result['newcomer_before'] else 'no'} |")
    print(f"| the holder (a member behind NAT) | 1 | {'yes' if result['holder'] else 'no'} |")
    print(f"| the stranger, one address, minted identities | {stranger['asked']} | {stranger['granted']} slots |")
    print(f"| a newcomer, after the stranger exited | 1 | {'yes' if result['newcomer_after'] else 'no'} |")
    print(f"| the holder's refresh, after | 1 | {'yes' if result['holder_refresh'] else 'no'} |")


if __name__ == "__main__":
    main()
