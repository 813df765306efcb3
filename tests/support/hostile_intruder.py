"""A non-member that tries anyway: the real `murmur join`, started as a process, with what it proves of its
membership replaced.

It skips the checks that stop an honest node without the swarm key or a certificate, admits every peer
itself (so it pulls from everyone it sees and would mix anything), and presents

- `--wrong-key`: proofs under a random key of its own (a key swarm), or
- `--stolen-certificate FILE`: another peer's certificate, as anyone can copy it from that peer's DHT
  record (an allowlist swarm).

Usage: python -m tests.support.hostile_intruder (--wrong-key | --stolen-certificate FILE) -- join ARGS...
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path

from gossip.wire import Header, HeaderFields, MetaValue
from node.net.admission import MEMBER_META, PROOF_META, Admission, read_certificate, record_proof, stream_proof
from node.swarm.recipe import AdmissionMode, parse_document


class ForgedAdmission(Admission):
    """Claims membership with what it has (a wrong key, a stolen certificate) and admits everyone."""

    def __init__(self, base: Admission, key: bytes | None, token: str | None) -> None:
        super().__init__(base.mode, base.swarm, founder=base.founder)
        self._forged_key, self._forged_token = key, token

    def record_credential(self, peer_id: str, heartbeat: float) -> str:
        if self._forged_key is not None:
            return record_proof(self._forged_key, self.swarm, peer_id, heartbeat)
        return self._forged_token or ""

    def credentials(self, fields: HeaderFields) -> Mapping[str, MetaValue]:
        if self._forged_key is not None:
            return {PROOF_META: stream_proof(self._forged_key, fields)}
        return {MEMBER_META: self._forged_token} if self._forged_token else {}

    def check_record(self, peer_id: str, heartbeat: float, credential: object) -> None:
        return None

    def admit(self, header: Header) -> None:
        return None

    @property
    def is_open(self) -> bool:
        return True  # it keeps everyone in its view


def forge_admission(key: bytes | None, token: str | None) -> None:
    """Replace the node's admission (the one behaviour replaced) with a ForgedAdmission presenting
    `key` (a key swarm) or `token` (an allowlist swarm). tests/support/hostile.py's wrong-key and
    stolen-certificate modes call this too."""
    import node.runtime.serve as serve

    def forged_admission(config, swarm, identity):  # type: ignore[no-untyped-def]
        mode = parse_document(swarm.config).admission_mode
        base = Admission(mode, config.swarm, founder=swarm.founder)
        print(f"hostile_intruder: claiming membership of a {mode} swarm with "
              f"{'a wrong key' if key else 'a stolen certificate'}", file=sys.stderr, flush=True)
        assert mode is not AdmissionMode.OPEN, "an open swarm admits everyone: nothing to intrude"
        return ForgedAdmission(base, key, token)

    serve.node_admission = forged_admission


def wrong_key() -> bytes:
    return secrets.token_hex(32).encode()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hostile_intruder")
    forged = parser.add_mutually_exclusive_group(required=True)
    forged.add_argument("--wrong-key", action="store_true")
    forged.add_argument("--stolen-certificate", type=Path)
    args, rest = parser.parse_known_args(argv)
    murmur_args = rest[1:] if rest[:1] == ["--"] else rest
    forge_admission(wrong_key() if args.wrong_key else None,
                    read_certificate(args.stolen_certificate).token if args.stolen_certificate else None)
    from node.cli.main import main as murmur

    return murmur(murmur_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
