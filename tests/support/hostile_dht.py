"""A hostile DHT peer, started as a process by the tests: it joins a swarm's DHT with keys of its own and
writes what an attacker would, in one of these modes (each bounded in count and time):

- `forge-config`: under `<swarm>.config`, a plain (unsigned) value, a config envelope it signed itself
  with a far expiration, the same with an ordinary one, an envelope claiming the founder's key with its
  own signature, and an oversized value; again every `--every` seconds until `--duration` is over.
- `flood-records`: `--count` fake peer records under `<swarm>.peers`: `--keys` of them from identities
  with real (2048-bit) keys of their own (each signs its own record: valid in an open swarm, proving no
  membership in another), some from 1024-bit keys no libp2p peer can have, and the rest in its own
  subkey but naming other peer ids. The real keys are made from pairs of a few generated primes (see
  `distinct_keys`): hundreds of distinct peer ids in a second, enough to fill a node's view beyond its cap.
  With `--work-bits B`, the first `--paid` real-keyed records carry a proof of work of B bits for their
  peer id (node.net.work: what an open swarm asking B bits admits); with `--duration`, the records are
  stored again every `--every` seconds until it is over (a sybil operator keeping its records live).
- `store-flood`: store RPCs straight to each `--probe` peer, `--count` entries each, again every
  `--every` seconds until `--duration` is over: one peer record signed by a key with a 1024-bit public
  exponent (a verify ~50x an ordinary one), half of the entries that one entry repeated, half of it
  with distinct expirations (so no two are identical). Without the store guard (node.net.dht_guard)
  each entry is verified again on the node's event loop.

It signs with its own keys and accepts anything itself; its DHT node runs in client mode and never
stores locally, so what it wrote lives only on the honest nodes (and `murmur bootstrap`) that accepted it. At the end it asks each
`--probe` peer directly (one DHT find RPC) what that peer holds under the key, and writes a JSON report:
what it tried, and for each probed peer which of its values that peer kept. Several modes run one
after the other in one process.

Usage: python -m tests.support.hostile_dht --mode forge-config [flood-records] --swarm S --peers MADDR... --identity FILE
       --report FILE [--probe MADDR...] [--founder PEER_ID] [--count N --keys K --config-hash H]
       [--duration S --every S]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import msgspec
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from node.config import NodeConfig, TrainingConfig
from node.net.founder import SignedConfig, sign_config
from node.net.identity import claim_identity, peer_id_of_ssh_key
from node.net.records import PeerRecord, config_key, encode_peer_record, peers_key
from node.net.transport.p2pd import P2PSettings, start_p2pd
from node.net.work import mint_work
from node.runtime.founding import swarm_document

MODES = ("forge-config", "flood-records", "store-flood")
STORE_TIMEOUT_S = 10.0
FLOOD_BATCH = 100


class SignsWithWhateverKey(RecordValidatorBase):  # type: ignore[misc]  # hivemind is untyped
    """The attacker's validator: signs each value with the key its subkey names (it holds all of them)
    and accepts everything it reads."""

    def __init__(self, keys: dict[bytes, RSAPrivateKey]) -> None:
        self.keys = keys  # owner marker -> private key

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        for marker, key in self.keys.items():
            if marker in record.subkey:
                return record.value + b"[signature:" + key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record))) \
                    + b"]"
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        stripped: bytes = RSASignatureValidator._SIGNATURE_RE.sub(b"", record.value)
        return stripped


def _key(bits: int) -> RSAPrivateKey:
    return _hivemind_key(rsa.generate_private_key(public_exponent=65537, key_size=bits))


def _hivemind_key(private: rsa.RSAPrivateKey) -> RSAPrivateKey:
    """hivemind's key around a cryptography key (what its own unpickling makes, without loading the key
    again from DER: that checks the primes, which costs about as much as generating a key)."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = private
    return key


def distinct_keys(count: int) -> list[RSAPrivateKey]:
    """`count` distinct 2048-bit RSA keys (so distinct peer ids), each the product of two of a few
    1024-bit primes taken from generated keys: k generated keys give 2k primes and k(2k - 1) keys, in
    about k generations' time instead of `count` (docs/benchmarks.md, "Small costs behind constants").
    An attacker may pay that; a test need not. Any two of the primes give a 2048-bit modulus (OpenSSL makes each prime
    at least sqrt(2) x 2^1023); the keys share factors, which nothing here checks and no validator can."""
    generated = 1
    while generated * (2 * generated - 1) < count:
        generated += 1
    primes: list[int] = []
    for _ in range(generated if count else 0):
        numbers = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_numbers()
        primes += [numbers.p, numbers.q]
    keys: list[RSAPrivateKey] = []
    for i, p in enumerate(primes):
        for q in primes[i + 1:]:
            if len(keys) == count:
                return keys
            n, e = p * q, 65537
            d = pow(e, -1, (p - 1) * (q - 1))
            numbers = rsa.RSAPrivateNumbers(p, q, d, rsa.rsa_crt_dmp1(d, p), rsa.rsa_crt_dmq1(d, q),
                                            rsa.rsa_crt_iqmp(p, q), rsa.RSAPublicNumbers(e, n))
            assert n.bit_length() == 2048, n.bit_length()
            keys.append(_hivemind_key(numbers.private_key(unsafe_skip_rsa_key_validation=True)))
    return keys


def large_exponent_key(exponent_bits: int = 1024, primes: tuple[int, int] | None = None) -> RSAPrivateKey:
    """A 2048-bit RSA key whose public exponent has `exponent_bits` bits instead of 65537's 17: a verify
    with it costs about exponent_bits / 17 times an ordinary one, its signing no more. From a generated
    key's primes (or `primes`), with the smallest exponent of that size coprime to (p - 1)(q - 1)."""
    if primes is None:
        numbers = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_numbers()
        primes = (numbers.p, numbers.q)
    p, q = primes
    phi = (p - 1) * (q - 1)
    e = (1 << (exponent_bits - 1)) + 1
    while math.gcd(e, phi) != 1:
        e += 2
    d = pow(e, -1, phi)
    private = rsa.RSAPrivateNumbers(p, q, d, rsa.rsa_crt_dmp1(d, p), rsa.rsa_crt_dmq1(d, q), rsa.rsa_crt_iqmp(p, q),
                                    rsa.RSAPublicNumbers(e, p * q))
    return _hivemind_key(private.private_key(unsafe_skip_rsa_key_validation=True))


def _marker(key: RSAPrivateKey) -> bytes:
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


def _fake_record(peer_id: str, config_hash: str, work: str = "") -> PeerRecord:
    return PeerRecord(peer_id=peer_id, maddrs=(f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id}",), step=10**9, round=10**9,
                      experts=(), capacity=2**62, version="evil", heartbeat=time.time(), gossip_from=1,
                      config_hash=config_hash, work=work)


async def _store(dht: DHTNode, key: str, value: bytes, expiration: float, subkey: bytes | None) -> bool:
    try:
        async with asyncio.timeout(STORE_TIMEOUT_S):
            return bool(await dht.store(key, value, expiration, subkey=subkey, exclude_self=True))
    except Exception:
        return False


async def founder_key_of(dht: DHTNode, swarm: str, founder: str) -> bytes | None:
    """The founder's public key, as its genuine envelope in the DHT carries it."""
    try:
        async with asyncio.timeout(STORE_TIMEOUT_S):
            found = await dht.get(config_key(swarm), latest=True)
    except Exception:
        return None
    for item in (found.value.values() if found is not None and isinstance(found.value, dict) else ()):
        try:
            envelope = msgspec.msgpack.decode(item.value, type=SignedConfig)
            if peer_id_of_ssh_key(envelope.founder_key) == founder:
                return envelope.founder_key
        except (msgspec.DecodeError, ValueError, TypeError):
            continue
    return None


async def forge_config(dht: DHTNode, own: RSAPrivateKey, swarm: str, founder_key: bytes | None) -> dict[str, bool]:
    """One round of forged configs; for each, whether any DHT node accepted it."""
    now = get_dht_time()
    evil = swarm_document(NodeConfig(training=TrainingConfig(model="vector"), dim=64, seed=666), epoch=time.time())
    forged = sign_config(own, swarm, 10**6, evil)  # a huge version: it would win if a joiner took it
    mine = _marker(own)
    attempts: dict[str, tuple[bytes, float, bytes | None]] = {
        "plain": (b"unsigned", now + 10**6, None),
        "own_key_far_expiration": (forged.signed, now + 10**6, mine),
    }
    if founder_key is not None:  # claims to be the founder: the founder's key, the attacker's signature
        envelope = msgspec.msgpack.decode(forged.signed, type=SignedConfig)
        attempts["claims_founder"] = (msgspec.msgpack.encode(msgspec.structs.replace(envelope, founder_key=founder_key)),
                                      now + 190, mine)
    attempts["own_key"] = (forged.signed, now + 200, mine)  # what a DHT node that knows no founder may keep
    attempts["oversized"] = (b"x" * (3 << 20), now + 210, mine)
    # one at a time: stores of one subkey at once would race each other on the replicas
    return {what: await _store(dht, config_key(swarm), *attempt) for what, attempt in attempts.items()}


async def flood_records(dht: DHTNode, validator: SignsWithWhateverKey, own: RSAPrivateKey, swarm: str,
                        count: int, keys: int, config_hash: str = "", *, work_bits: int = 0, paid: int = 0,
                        duration: float = 0.0, every: float = 2.0) -> tuple[dict[str, int], list[str]]:
    """`count` fake peer records (bounded), stored in batches: how many of each kind were tried and
    accepted, and the peer ids of the real-keyed ones. The records name `config_hash` (the swarm's,
    `--config-hash`: a node leaves records of another config out of its view, so without it none of
    them reaches a view); the first `paid` real-keyed ones a proof of `work_bits` bits. Stored again every
    `every` seconds until `duration` is over (once without)."""
    weak = min(100, max(0, count - keys))
    # key generation takes seconds: off the event loop (a node running this keeps its rounds)
    identities = await asyncio.to_thread(lambda: distinct_keys(min(keys, count)) + [_key(1024) for _ in range(weak)])
    for key in identities:
        validator.keys[_marker(key)] = key
    ids = [peer_id_of_ssh_key(key.get_public_key().to_bytes()) for key in identities]
    nonces = await asyncio.to_thread(lambda: [mint_work(swarm, ids[i], work_bits) if i < min(paid, keys) else ""
                                              for i in range(len(ids))])
    jobs: list[tuple[str, bytes, bytes]] = []
    for i, key in enumerate(identities):
        kind = ("paid_key" if nonces[i] else "real_key") if i < keys else "weak_key"
        jobs.append((kind, _marker(key), encode_peer_record(_fake_record(ids[i], config_hash, nonces[i]))))
    own_marker = _marker(own)
    for i in range(count - len(identities)):  # in its own subkey, naming peer ids that are not its own
        fake = "Qm" + f"{i:044d}".replace("0", "z")
        jobs.append(("not_owner", own_marker, encode_peer_record(_fake_record(fake, config_hash))))
    if not jobs:
        return {}, []
    tried = {kind: sum(1 for job in jobs if job[0] == kind)
             for kind in ("real_key", "paid_key", "weak_key", "not_owner")}
    accepted = {kind: 0 for kind in tried}
    deadline = time.monotonic() + duration
    for _ in range(max(1, math.ceil(duration / every) + 1)):  # bounded by duration / every
        expiration = get_dht_time() + 60
        accepted = {kind: 0 for kind in tried}
        for start in range(0, len(jobs), FLOOD_BATCH):  # one store RPC per DHT node and batch
            batch = jobs[start:start + FLOOD_BATCH]
            try:
                async with asyncio.timeout(STORE_TIMEOUT_S):
                    stored = await dht.store_many([peers_key(swarm)] * len(batch), [value for _, _, value in batch],
                                                  expiration, subkeys=[marker for _, marker, _ in batch],
                                                  exclude_self=True)
            except Exception:
                continue
            kinds = {marker: kind for kind, marker, _ in batch}
            for (_, marker), ok in stored.items():
                accepted[kinds[marker]] += bool(ok)
        if time.monotonic() + every > deadline:
            break
        await asyncio.sleep(every)
    real = ids[:keys]
    # `accepted`: by the DHT node that answered last, per distinct subkey (hivemind reports no more)
    return {**{f"tried_{k}": v for k, v in tried.items()}, **{f"accepted_{k}": v for k, v in accepted.items()}}, real


async def store_flood(dht: DHTNode, swarm: str, targets: list[str], count: int, duration: float,
                      every: float) -> dict[str, int]:
    """Store requests full of one large-exponent entry (repeated, and with distinct expirations) to each
    of `targets`, for `duration` seconds: how many requests and entries were sent, answered and accepted."""
    key = await asyncio.to_thread(large_exponent_key, 1024)
    validator = SignsWithWhateverKey({_marker(key): key})
    peer_id = peer_id_of_ssh_key(key.get_public_key().to_bytes())
    key_id = DHTID.generate(source=peers_key(swarm))
    subkey = _marker(key)
    sent = {"requests": 0, "entries": 0, "answered": 0, "accepted": 0}
    peers = [PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1]) for maddr in targets]
    deadline = time.monotonic() + duration
    while True:
        expiration = get_dht_time() + 60
        expirations = [expiration] * (count // 2) + [expiration + i * 1e-3 for i in range(1, count - count // 2 + 1)]
        values = []
        for item_expiration in expirations:  # each signed for its own expiration (the repeats share one)
            record = DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(subkey),
                               MSGPackSerializer.dumps(encode_peer_record(_fake_record(peer_id, ""))), item_expiration)
            if values and item_expiration == expiration:
                values.append(values[0])
                continue
            values.append(validator.sign_value(record))
        for peer in peers:
            try:
                async with asyncio.timeout(STORE_TIMEOUT_S):
                    stored = await dht.protocol.call_store(peer, [key_id] * count, values, expirations,
                                                           subkeys=[subkey] * count)
            except Exception:
                stored = None
            sent["requests"] += 1
            sent["entries"] += count
            if stored is not None:
                sent["answered"] += 1
                sent["accepted"] += sum(bool(ok) for ok in stored)
        if time.monotonic() + every > deadline:
            return sent
        await asyncio.sleep(every)


async def probe(dht: DHTNode, maddr: str, key: str) -> dict[str, object]:
    """What the peer at `maddr` holds under `key`, asked directly: subkey owner -> (value size, expires in)."""
    peer = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])
    key_id = DHTID.generate(source=key)
    async with asyncio.timeout(STORE_TIMEOUT_S):
        found = await dht.protocol.call_find(peer, [key_id])
    if not found or found.get(key_id) is None or found[key_id][0] is None:
        return {}
    value = found[key_id][0]
    now = get_dht_time()
    if not isinstance(value.value, DictionaryDHTValue):  # a plain value
        return {"plain": {"bytes": len(value.value), "expires_in": value.expiration_time - now}}
    held: dict[str, object] = {}
    for subkey, item in value.value.items():
        owner = "?"
        if isinstance(subkey, bytes) and b"[owner:" in subkey:
            try:
                owner = peer_id_of_ssh_key(subkey.split(b"[owner:", 1)[1].rstrip(b"]"))
            except ValueError:
                owner = "weak"
        held[owner] = {"bytes": len(item.value) if isinstance(item.value, bytes) else -1,
                       "expires_in": item.expiration_time - now}
    return held


async def main(args: argparse.Namespace) -> int:
    report: dict[str, object] = {"mode": args.mode}
    with claim_identity(args.identity) as claimed:
        own = claimed.identity.signing_key
        report["peer_id"] = claimed.identity.peer_id
        validator = SignsWithWhateverKey({_marker(own): own})
        p2p = await start_p2pd(P2PSettings(identity_path=claimed.identity.path, initial_peers=tuple(args.peers)))
        try:
            async with asyncio.timeout(20):
                dht = await DHTNode.create(p2p=p2p, initial_peers=list(args.peers), record_validator=validator,
                                           client_mode=True, wait_timeout=5.0)
            try:
                held: dict[str, dict[str, object]] = {}
                for mode in args.mode:  # in the order given
                    if mode == "forge-config":
                        founder_key = await founder_key_of(dht, args.swarm, args.founder) if args.founder else None
                        report["found_founder_key"] = founder_key is not None
                        rounds = []
                        deadline = time.monotonic() + args.duration
                        while True:
                            rounds.append(await forge_config(dht, own, args.swarm, founder_key))
                            if time.monotonic() + args.every > deadline:
                                break
                            await asyncio.sleep(args.every)
                        report["forged"] = rounds
                        key, what = config_key(args.swarm), "config"
                    elif mode == "store-flood":
                        report["store_flood"] = await store_flood(dht, args.swarm, args.probe, args.count,
                                                                  args.duration, args.every)
                        key, what = peers_key(args.swarm), "peers"
                    else:
                        report["flood"], report["real_key_peer_ids"] = await flood_records(
                            dht, validator, own, args.swarm, args.count, args.keys, args.config_hash,
                            work_bits=args.work_bits, paid=args.paid, duration=args.duration, every=args.every)
                        key, what = peers_key(args.swarm), "peers"
                    held[what] = {maddr: await probe(dht, maddr, key) for maddr in args.probe}
                report["held"] = held
            finally:
                await dht.shutdown()
        finally:
            await p2p.shutdown()
    args.report.write_text(json.dumps(report, indent=1))
    print("hostile_dht: done", flush=True)
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hostile_dht")
    parser.add_argument("--mode", choices=MODES, nargs="+", required=True, help="one or more, run in this order")
    parser.add_argument("--swarm", required=True)
    parser.add_argument("--peers", nargs="+", required=True)
    parser.add_argument("--identity", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--probe", nargs="*", default=[])
    parser.add_argument("--founder")
    parser.add_argument("--config-hash", default="", help="the swarm's, in the flooded records")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--work-bits", type=int, default=0, help="flood-records: the proof of work of the paid records")
    parser.add_argument("--paid", type=int, default=0, help="flood-records: real-keyed records that carry a proof")
    parser.add_argument("--duration", type=float, default=0.0)
    parser.add_argument("--every", type=float, default=2.0)
    args = parser.parse_args(argv)
    if not 0 < args.count <= 5000 or not 0 <= args.keys <= 1000 or not 0 <= args.duration <= 300 \
            or not 0 <= args.work_bits <= 16 or args.every <= 0:
        parser.error("bounded: --count 1..5000, --keys 0..1000, --duration 0..300, --work-bits 0..16, --every > 0")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
