"""The `murmur` command line: the top-level parser, built from one module per command
(node.cli.<command>: its parser and its handler), and the dispatch to the chosen command.

Bad flags and values exit with status 2 and one line saying what is wrong. Heavy imports (torch,
hivemind) happen inside the commands that need them, so `murmur topology` and `--help` stay quick.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from node.cli import demo, doctor, export, invite, node, plan, sim, status, tokenizer, topology
from node.cli import eval as evaluate
from node.cli.args import OneLineErrorParser, UsageError
from node.cli.node import node_config_from_args
from node.config import DAEMONS, ConfigError, NodeConfig

# In the order `murmur --help` lists them; `node` adds node, join and bootstrap.
COMMANDS = (topology, sim, node, status, evaluate, doctor, invite, demo, plan, export, tokenizer)


class _ConfigErrorParser(OneLineErrorParser):
    """The same parser for `parse_node_config`: a usage error raises ConfigError instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser(parser_class: type[argparse.ArgumentParser] = OneLineErrorParser) -> argparse.ArgumentParser:
    parser = parser_class(
        prog="murmur",
        description="murmur: peer-to-peer decentralized training. Nodes find each other through a DHT "
        "and mix parameters with their neighbours by gossip.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def parse_node_config(argv: Sequence[str], env: Mapping[str, str]) -> NodeConfig:
    """The config a `murmur node|join|bootstrap ...` command line would run with, without running it.

    `argv` starts with the command, e.g. ["join", "--peers", ADDR]; `env` stands for os.environ.
    Every bad flag or value raises ConfigError with the line `murmur` would print.
    """
    args = build_parser(_ConfigErrorParser).parse_args(argv)
    if args.command not in DAEMONS:
        raise ConfigError(f"murmur {args.command} does not run a node")
    return node_config_from_args(args, env)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except (UsageError, ConfigError) as exc:
        print(f"murmur {args.command}: error: {exc}", file=sys.stderr)
        return 2
