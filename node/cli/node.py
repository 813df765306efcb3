"""`murmur node`, `murmur join` and `murmur bootstrap`: the commands that run a node, one parser
builder for the three (their flags are the settings of docs/cli.md), and the checked config each runs."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping

from node.cli.args import PRECEDENCE, add_config_flag, add_setting_flag, resolve
from node.config import NODE, Command, ConfigError, NodeConfig, ResolvedConfig, check_environment, settings_for

# Help sections of the node commands, by the first part of a setting's key.
_SECTIONS = {"network": "network", "monitor": "monitor page", "gossip": "gossip", "training": "training"}


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    node = commands.add_parser(
        Command.NODE, help="found a new swarm and run a node in it", epilog=PRECEDENCE,
        description="Found a new swarm and run a node in it: join the DHT (through --peers if given, e.g. a "
        "bootstrap node), publish the swarm's config, gossip parameters with topology neighbours and serve "
        "the monitor page. SIGINT/SIGTERM stop it cleanly; restarting with the same identity and data dir resumes.",
    )
    join = commands.add_parser(
        Command.JOIN, help="join an existing swarm through one of its peers", epilog=PRECEDENCE,
        description="Join an existing swarm: read its config from the DHT through --peers (at least one, from "
        "the flag, MURMUR_PEERS or the config file), fetch the latest parameters from a live peer, then train "
        "and gossip with the swarm. Before it trains it prints four 'murmur: preflight' lines: the swarm's model "
        "and algorithm, whether they fit this machine's RAM and GPU (the numbers, and the SPES capacity chosen), "
        "the round-trip time and goodput to the first --peers, and whether peers reach this node directly or "
        "through a relay; a failed check says what to do.",
    )
    bootstrap = commands.add_parser(
        Command.BOOTSTRAP, help="run a DHT-only entry point for public swarms", epilog=PRECEDENCE,
        description="Run a DHT-only entry point for public swarms: no training and no gossip. Other nodes pass "
        "its full multiaddr (printed at start) to --peers.",
    )
    for command, parser in ((Command.NODE, node), (Command.JOIN, join), (Command.BOOTSTRAP, bootstrap)):
        add_config_flag(parser)
        sections = {title: parser.add_argument_group(title) for title in ("general", *_SECTIONS.values())}
        for setting in settings_for(command):
            section = _SECTIONS.get(setting.key.partition(".")[0], "general")
            required = command == Command.JOIN and setting.key == "network.initial_peers"
            add_setting_flag(sections[section], setting, required_note=required)
        parser.set_defaults(run=_run_node if command in NODE else _run_bootstrap)


def node_config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> NodeConfig:
    """The checked config of a parsed `node`, `join` or `bootstrap` command line; raises ConfigError."""
    resolved = resolve(args, env)
    if args.command == Command.JOIN and not resolved.config.network.initial_peers:
        raise ConfigError("no peer to join through: give --peers MULTIADDR (or MURMUR_PEERS, or "
                          "network.initial_peers in the config file)")
    network = resolved.config.network
    if network.reachability == "private" and network.serves_relay(bootstrap=args.command == Command.BOOTSTRAP):
        raise ConfigError(f"{resolved.source('network.reachability')}: a relay must be reachable directly, so it "
                          "cannot run with --reachability private (add --no-relay-service)")
    check_environment(resolved, swarm=args.command in NODE, monitor=args.command in NODE)
    if args.command == Command.NODE:
        _check_founders_recipe(resolved)
        return resolved.config
    if args.command == Command.JOIN:
        return _with_invite(resolved)
    return resolved.config


def _with_invite(resolved: ResolvedConfig) -> NodeConfig:
    """A joiner's config with its invite's swarm name and founder (which must agree with --swarm and
    --founder where those are given too)."""
    config = resolved.config
    if config.invite is None:
        return config
    from node.net.founder import parse_invite

    try:
        invite = parse_invite(config.invite)
    except ValueError as exc:
        raise ConfigError(f"{resolved.source('invite')}: {exc}") from None
    for key, given, wanted in (("swarm", config.swarm, invite.swarm), ("founder", config.founder, invite.founder)):
        if key in resolved.sources and given != wanted:
            raise ConfigError(f"{resolved.source(key)}: {given!r} differs from the invite's {wanted!r} "
                              f"({resolved.source('invite')}); give one of them")
    return dataclasses.replace(config, swarm=invite.swarm, founder=invite.founder)


def _check_founders_recipe(resolved: ResolvedConfig) -> None:
    """A founder's recipe must be one every node accepts (node.swarm.recipe's bounds): refuse it here,
    naming the setting, rather than publish a document its own swarm would refuse."""
    from node.runtime.founding import SETTING_OF_FIELD, swarm_document
    from node.swarm.recipe import RecipeInvalid, field_at_fault

    config = resolved.config
    if config.training.trains_model:  # the flags' bounds, without reading a model's or tokenizer's files here
        config = dataclasses.replace(config, training=dataclasses.replace(config.training, model="moe",
                                                                            tokenizer=None))
    try:
        swarm_document(config, 0.0)
    except RecipeInvalid as exc:
        fault = field_at_fault(exc)
        key = SETTING_OF_FIELD.get(fault[0]) if fault is not None else None
        if fault is None or key is None:
            raise ConfigError(f"the swarm's recipe: {exc}") from None
        raise ConfigError(f"{resolved.source(key)}: {fault[1]}") from None


def _run_node(args: argparse.Namespace) -> int:
    config = node_config_from_args(args, os.environ)
    from node.runtime.allocator import bound_allocator_slack
    from node.runtime.serve import run_node
    from node.train.trainer import resolve_device

    # before the model and the peers allocate
    bound_allocator_slack(os.environ, resolve_device(config.training.device).type)

    exit_status: int = run_node(config, founding=args.command == Command.NODE)
    return exit_status


def _run_bootstrap(args: argparse.Namespace) -> int:
    config = node_config_from_args(args, os.environ)
    from node.runtime.serve import run_bootstrap

    exit_status: int = run_bootstrap(config)
    return exit_status

