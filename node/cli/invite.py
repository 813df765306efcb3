"""`murmur invite`: a founder admits a peer to an allowlist swarm by issuing its membership certificate,
signed with the founder's identity key."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from node.cli.args import PRECEDENCE, UsageError, add_config_flag, add_setting_flag, number, resolve
from node.config import Command, settings_for


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    invite = commands.add_parser(
        Command.INVITE, help="admit a peer to an allowlist swarm: issue its membership certificate (founder)",
        epilog=PRECEDENCE,
        description="Issue the membership certificate of PEER_ID in the swarm, signed with the founder's identity "
        "key: run it where the founder's node runs (its --data-dir or --identity; the running node may keep "
        "running). The peer joins with `murmur join --invite SWARM@FOUNDER --certificate FILE`. Only an allowlist "
        "swarm (`murmur node --admission allowlist`) asks for certificates.")
    add_config_flag(invite)
    invite.add_argument("peer_id", metavar="PEER_ID", help="peer id of the node to admit (its `murmur status` shows it)")
    for setting in settings_for(Command.INVITE):
        add_setting_flag(invite, setting)
    invite.add_argument("--valid-days", type=number(float, lo=0.001, hi=36500), default=365.0, metavar="DAYS",
                        help="days until the certificate expires (default 365)")
    invite.add_argument("--out", type=Path, metavar="FILE", help="write the certificate to FILE instead of stdout")
    invite.set_defaults(run=_run_invite)


def _run_invite(args: argparse.Namespace) -> int:
    import time

    from node.net.founder import check_peer_id, issue_certificate
    from node.net.identity import IdentityError, load_identity

    config = resolve(args, os.environ).config
    try:
        peer_id = check_peer_id(args.peer_id)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not config.identity_path.exists():
        raise UsageError(f"no founder identity at {config.identity_path}: run `murmur invite` with the founder "
                         "node's --data-dir or --identity")
    try:
        identity = load_identity(config.identity_path)
    except IdentityError as exc:
        raise UsageError(str(exc)) from None
    certificate = issue_certificate(identity.signing_key, config.swarm, peer_id,
                                    int(time.time() + args.valid_days * 86400))
    if args.out is None:
        sys.stdout.write(certificate.text)
    else:
        try:
            args.out.write_text(certificate.text)
        except OSError as exc:
            raise UsageError(f"--out {args.out}: {exc.strerror}") from None
    print(f"murmur invite: {peer_id} may join swarm {config.swarm!r} until "
          f"{time.strftime('%Y-%m-%d', time.gmtime(certificate.expires))} with `murmur join --invite "
          f"{config.swarm}@{identity.peer_id} --certificate FILE`", file=sys.stderr)
    return 0
