"""A hostile DHT peer, started as a process by the tests: it joins a swarm's DHT with a key of its own
and, every `--every` seconds for `--duration` seconds, publishes its own peer record (in its own signed
subkey, naming the swarm's config hash: valid in every other way) whose addresses do not parse as
multiaddrs (a port beyond 65535, an ip4 of 999, an unknown protocol). Honest nodes refuse the record as
a whole (`dht_refused_bad_address`) and never dial it. It writes a JSON report of its stores.

Usage: python tests/support/hostile_address.py --swarm S --peers MADDR... --identity FILE --report FILE
       --config-hash H [--duration S --every S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from hivemind.dht.node import DHTNode
from hivemind.utils.timed_storage import get_dht_time
from hostile_dht import SignsWithWhateverKey, _marker, _store

from node.net.identity import claim_identity
from node.net.records import PeerRecord, encode_peer_record, peers_key
from node.net.transport.p2pd import P2PSettings, start_p2pd


def bad_addresses(peer_id: str) -> tuple[str, ...]:
    return (f"/ip4/127.0.0.1/tcp/99999/p2p/{peer_id}", f"/ip4/999.1.1.1/tcp/1/p2p/{peer_id}",
            f"/garbage/proto/p2p/{peer_id}")


async def main(args: argparse.Namespace) -> int:
    report: dict[str, object] = {}
    with claim_identity(args.identity) as claimed:
        own = claimed.identity.signing_key
        me = claimed.identity.peer_id
        report["peer_id"] = me
        validator = SignsWithWhateverKey({_marker(own): own})
        p2p = await start_p2pd(P2PSettings(identity_path=claimed.identity.path, initial_peers=tuple(args.peers)))
        try:
            async with asyncio.timeout(20):
                dht = await DHTNode.create(p2p=p2p, initial_peers=list(args.peers), record_validator=validator,
                                           client_mode=True, wait_timeout=5.0)
            try:
                stores: list[bool] = []
                deadline = time.monotonic() + args.duration
                while True:
                    record = PeerRecord(peer_id=me, maddrs=bad_addresses(me), step=1, round=1, experts=(),
                                        capacity=0, version="evil", heartbeat=get_dht_time(),
                                        config_hash=args.config_hash)
                    stores.append(await _store(dht, peers_key(args.swarm), encode_peer_record(record),
                                               get_dht_time() + 30, _marker(own)))
                    if time.monotonic() + args.every > deadline:
                        break
                    await asyncio.sleep(args.every)
                report["stores"] = stores
            finally:
                await dht.shutdown()
        finally:
            await p2p.shutdown()
    args.report.write_text(json.dumps(report, indent=1))
    print("hostile_address: done", flush=True)
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hostile_address")
    parser.add_argument("--swarm", required=True)
    parser.add_argument("--peers", nargs="+", required=True)
    parser.add_argument("--identity", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--config-hash", default="")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--every", type=float, default=1.0)
    args = parser.parse_args(argv)
    if not 0 <= args.duration <= 60 or not 0.1 <= args.every <= 10:
        parser.error("bounded: --duration 0..60, --every 0.1..10")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
