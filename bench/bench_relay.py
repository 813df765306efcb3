"""Relayed against direct goodput between two nodes behind NAT, on the same shaped links.

Two home LANs behind NAT routers and a public relay in network namespaces (tests/support/nat.py), every
host's uplink and every router's downlink limited to 100 Mbit/s with tc tbf. A node in home 1 pushes bytes
over a p2pd stream to a node in home 0:

- relayed: through the circuit of a `murmur bootstrap`-style relay (its configured limits in force),
  the home-0 node reserving a slot there as a node behind NAT does;
- direct: the same two nodes once the home-0 router forwards the node's port (what a volunteer does
  for `--announce`), so the bytes cross the same home links without the relay. The port is opened only
  after the relayed pushes: with it open, libp2p would move the relayed peers onto a direct connection
  (identify tells the dialler the forwarded address) and the relayed figure would measure that.

Printed: each path's goodput in Mbit/s (best of the repeats), relayed / direct, and relayed / link rate
(target 0.8). Needs root, `ip`, `tc`, `iptables`. Figures: docs/benchmarks.md.

Run from the repository root: .venv/bin/python -m bench.bench_relay [--mib 48] [--repeats 3] [--rate 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTOCOL = "/murmur/bench-relay/1"
PORT = 40123  # the home-0 node's fixed port (forwarded on its router for the direct path)
TARGET = 0.8
ROLE_TIMEOUT_S = 300.0
_CHUNK = 1 << 20


async def _sink(info, reader, writer) -> None:
    """Read an 8-byte length and that many bytes; answer the count."""
    wanted = int.from_bytes(await reader.readexactly(8), "big")
    got = 0
    while got < wanted:
        got += len(await reader.readexactly(min(_CHUNK, wanted - got)))
    writer.write(got.to_bytes(8, "big"))
    await writer.drain()
    await reader.read(1)
    writer.close()


async def relay_role(spec: dict) -> None:
    from node.net.hivemind_adapter import RelayLimits
    from node.net.probe import relay_limits_in_force
    from node.net.transport.p2pd import P2PSettings, start_p2pd
    from node.runtime.host import RELAY_SERVICE_ATTEMPTS

    settings = P2PSettings(identity_path=None, host_maddrs=(spec["listen"],), relay_service=RelayLimits(8 << 30, 3600))

    async def restart(old):
        await old.shutdown()
        return await start_p2pd(settings)

    p2p, check = await relay_limits_in_force(await start_p2pd(settings), restart, RELAY_SERVICE_ATTEMPTS)
    print(json.dumps({"maddrs": [str(m) for m in await p2p.get_visible_maddrs()], "check": check.verdict.value}),
          flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the driver closes our stdin
    await p2p.shutdown()


async def target_role(spec: dict) -> None:
    from node.net.transport.p2pd import P2PDTransport, P2PSettings, start_p2pd

    relay = spec["relay"]
    p2p = await start_p2pd(P2PSettings(identity_path=None, host_maddrs=(f"/ip4/0.0.0.0/tcp/{PORT}",),
                                       announce_maddrs=(spec["announce"],), relays=(relay,),
                                       force_reachability="private"))
    await p2p.add_binary_stream_handler(PROTOCOL, _sink)
    await P2PDTransport(p2p).connect(relay.rsplit("/p2p/", 1)[1], [relay])
    print(json.dumps({"peer_id": p2p.peer_id.to_base58()}), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await p2p.shutdown()


async def client_role(spec: dict) -> dict:
    from node.net.probe import throwaway_daemon
    from node.net.transport.p2pd import P2PDTransport

    results = []
    async with throwaway_daemon(listen=("/ip4/0.0.0.0/tcp/0",)) as p2p:
        client = P2PDTransport(p2p, open_timeout_s=60)
        deadline = time.monotonic() + 30
        while True:
            try:
                await client.connect(spec["peer"], spec["addrs"])
                break
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)
        nbytes = int(spec["mib"] * (1 << 20))
        block = bytes(_CHUNK)
        for _ in range(spec["repeats"]):
            stream = await client.open_stream(spec["peer"], PROTOCOL)
            started = time.perf_counter()
            await stream.write(nbytes.to_bytes(8, "big"))
            for offset in range(0, nbytes, _CHUNK):
                await stream.write(block[: min(_CHUNK, nbytes - offset)])
            confirmed = int.from_bytes(await stream.read_exactly(8), "big")
            seconds = time.perf_counter() - started
            stream.abort()
            assert confirmed == nbytes, (confirmed, nbytes)
            results.append(nbytes * 8 / seconds / 1e6)
            links = [str(a) for info in await p2p.list_peers() if info.peer_id.to_base58() == spec["peer"]
                     for a in info.addrs]
            if spec["relayed"] != all("/p2p-circuit" in a for a in links):
                raise SystemExit(f"the push did not take the path measured: {links}")
        await client.close()
    return {"mbit_s": results, "links": links}


def _role(host, role: str, spec: dict) -> subprocess.Popen[str]:
    return subprocess.Popen(host.command([sys.executable, "-m", "bench.bench_relay", "--role", role, "--spec",
                                          json.dumps(spec)]), cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _first_line(process: subprocess.Popen[str], what: str) -> dict:
    line = process.stdout.readline() if process.stdout else ""
    if not line:
        raise SystemExit(f"the {what} did not start (exit {process.poll()})")
    return json.loads(line)


def run(mib: float, repeats: int, rate: float) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from support.nat import forward_port, internet

    with internet("brly", publics=1, homes=2, rate_mbit=rate) as net:
        pub, home0, home1 = net.publics[0], net.homes[0], net.homes[1]
        relay = _role(pub, "relay", {"listen": pub.tcp_maddr(4001)})
        target = None
        try:
            relay_info = _first_line(relay, "relay")
            relay_maddr = next(m for m in relay_info["maddrs"] if pub.address in m)
            direct = f"/ip4/{home0.router.address}/tcp/{PORT}"
            target = _role(home0.host, "target", {"relay": relay_maddr, "announce": direct})
            peer = _first_line(target, "home-0 node")["peer_id"]
            time.sleep(1.0)  # its reservation follows its connection to the relay
            out = {}
            for path, addrs in (("relayed", [f"{relay_maddr}/p2p-circuit/p2p/{peer}"]), ("direct", [f"{direct}/p2p/{peer}"])):
                if path == "direct":  # only now: with the port open, libp2p would leave the relay at once
                    forward_port(home0, PORT)
                done = subprocess.run(home1.host.command([sys.executable, "-m", "bench.bench_relay", "--role", "client",
                                                          "--spec", json.dumps({"peer": peer, "addrs": addrs, "mib": mib,
                                                                                "repeats": repeats,
                                                                                "relayed": path == "relayed"})]),
                                      cwd=REPO, capture_output=True, text=True, timeout=ROLE_TIMEOUT_S)
                if done.returncode != 0:
                    raise SystemExit(f"the {path} client failed: {done.stderr[-2000:]}")
                out[path] = json.loads(done.stdout.strip().splitlines()[-1])
            out["relay_check"] = relay_info["check"]
            return out
        finally:
            for process in (target, relay):
                if process is not None:
                    if process.stdin:
                        process.stdin.close()
                    try:
                        process.wait(10)
                    except subprocess.TimeoutExpired:
                        process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=48.0, help="MiB per push (default 48)")
    parser.add_argument("--repeats", type=int, default=3, help="pushes per path; the best counts (default 3)")
    parser.add_argument("--rate", type=float, default=100.0, help="tbf rate of every link, Mbit/s (default 100)")
    parser.add_argument("--role", choices=("relay", "target", "client"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        spec = json.loads(args.spec)
        if args.role == "client":
            print(json.dumps(asyncio.run(client_role(spec))))
        else:
            asyncio.run({"relay": relay_role, "target": target_role}[args.role](spec))
        return
    result = run(args.mib, args.repeats, args.rate)
    relayed, direct = max(result["relayed"]["mbit_s"]), max(result["direct"]["mbit_s"])
    print(json.dumps(result))
    print(f"relay check at start: {result['relay_check']}")
    print(f"relayed: {relayed:.1f} Mbit/s over {result['relayed']['links']}")
    print(f"direct:  {direct:.1f} Mbit/s over {result['direct']['links']}")
    print(f"relayed / direct = {relayed / direct:.2f}; relayed / link ({args.rate:g} Mbit/s) = "
          f"{relayed / args.rate:.2f} (target {TARGET})")


if __name__ == "__main__":
    main()
