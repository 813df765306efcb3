"""What the command modules share: the parser class whose errors are one line and exit 2, argparse
types for numbers and edge lists, the flags of a setting, a topology and a config file, and how a
command's settings resolve (defaults < config file < environment < flags)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

from node.config import (
    DEFAULTS,
    ENV_CONFIG_FILE,
    SETTINGS_BY_KEY,
    Boolean,
    Choice,
    EdgeList,
    Kind,
    Multiaddrs,
    ResolvedConfig,
    Setting,
    default_in_words,
    merge_layers,
    read_config_file,
    read_environment,
    read_flags,
    setting_value,
    settings_for,
)
from topology import WEIGHT_SCHEMES, TopologySpec

# The epilog of the commands that read settings.
PRECEDENCE = (
    "Each setting comes from, in increasing precedence: its default, the --config file (TOML), its "
    "MURMUR_* environment variable, its flag. A bad flag or value exits with status 2 and one line. "
    "All settings: docs/cli.md."
)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class UsageError(Exception):
    """A value that parsed but makes no sense together with the others; the CLI exits with status 2."""


def number(
    kind: type[int] | type[float], lo: float | None = None, hi: float | None = None, hi_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: `kind` parsed from text, at least `lo` and at most (or below) `hi`."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"{text} is below the minimum {lo}")
        if hi is not None and (value >= hi if hi_open else value > hi):
            raise argparse.ArgumentTypeError(f"{text} must be {'below' if hi_open else 'at most'} {hi}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


positive_int = number(int, lo=1)
non_negative_int = number(int, lo=0)
probability = number(float, lo=0.0, hi=1.0, hi_open=True)
non_negative_float = number(float, lo=0.0)


def edge_list(text: str) -> tuple[tuple[int, int], ...]:
    """'0-1,1-2,2-0' -> ((0, 1), (1, 2), (2, 0)), parsed as the config file and environment parse it."""
    try:
        edges = EdgeList().from_text(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not edges:
        raise argparse.ArgumentTypeError(f"{text!r} is not an edge list like 0-1,1-2,2-0")
    return edges


def add_topology_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=WEIGHT_SCHEMES, help="mixing-weight scheme (default: the family's own)")
    p.add_argument("--degree", type=positive_int, default=4, help="degree of random-regular (default 4)")
    p.add_argument("--topology-seed", type=non_negative_int, default=0, help="seed of random-regular (default 0)")
    p.add_argument("--rows", type=positive_int, help="rows of the torus (default: the most square shape)")
    p.add_argument("--edges", type=edge_list, help="edge list of the custom topology over ranks, e.g. 0-1,1-2,2-0")


def topology_spec(args: argparse.Namespace, name: str) -> TopologySpec:
    """The topology `add_topology_options`'s flags describe for family `name`."""
    if name == "custom" and not args.edges:
        raise UsageError("the custom topology needs --edges, e.g. --edges 0-1,1-2,2-0")
    return TopologySpec(name, weights=args.weights, degree=args.degree, seed=args.topology_seed,
                        rows=args.rows, edges=args.edges or ())


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help=f"TOML config file whose keys are those of docs/cli.md (env {ENV_CONFIG_FILE}); "
                        "MURMUR_* variables and flags override it")


def add_setting_flag(
    container: argparse._ActionsContainer, setting: Setting, required_note: bool = False, help: str | None = None,
    default_text: str | None = None,
) -> None:
    """A flag whose default is SUPPRESS, so the namespace holds only the flags the user gave; `default_text`
    is the default in words where the command's own differs from the setting's."""
    choices = f"; one of: {', '.join(setting.kind.choices)}" if isinstance(setting.kind, Choice) else ""
    note = "required: at least one, from this flag, the env var or the config file; " if required_note else ""
    help_text = (f"{help or setting.help}{choices} ({note}default: {default_text or default_in_words(setting)}; "
                 f"env {setting.env}; config key {setting.key})").replace("%", "%%")
    common: dict[str, Any] = {"dest": setting.dest, "default": argparse.SUPPRESS, "help": help_text}
    if isinstance(setting.kind, Boolean):
        container.add_argument(setting.flag, action=argparse.BooleanOptionalAction, **common)
    elif isinstance(setting.kind, Multiaddrs):
        container.add_argument(setting.flag, action="extend", nargs="+", metavar=setting.metavar, **common)
    else:
        container.add_argument(setting.flag, metavar=setting.metavar, **common)


def add_knob_flag(container: argparse._ActionsContainer, key: str, help: str, **overrides: Any) -> None:
    """A command's own flag for a knob of the settings table (`murmur plan` models a swarm's recipe): its
    name, its parser (bounds, choices) and its default are the setting's, so they cannot drift from the
    node's; the help is the command's, with %(default)s for the default. Unlike `add_setting_flag`, the
    namespace holds the value under the flag's plain name, default included: such a command reads no
    environment or config file. `overrides` go to add_argument as they are (a store_true action...)."""
    setting = SETTINGS_BY_KEY[key]
    options: dict[str, Any] = {"default": setting_value(DEFAULTS, key), "help": help}
    if isinstance(setting.kind, Choice):
        options["choices"] = setting.kind.choices
    elif isinstance(setting.kind, Boolean):
        options["action"] = argparse.BooleanOptionalAction
    else:
        options["type"] = kind_type(setting.kind)
    container.add_argument(setting.flag, **{**options, **overrides})


def kind_type(kind: Kind) -> Callable[[str], object]:
    """An argparse type that parses and checks text as the setting's kind does for flags and `MURMUR_*`."""

    def parse(text: str) -> object:
        try:
            return kind.from_text(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> ResolvedConfig:
    """Defaults < config file < environment < flags, for the settings of `args.command`."""
    settings = settings_for(args.command)
    layers = []
    config_file = args.config if args.config is not None else env.get(ENV_CONFIG_FILE, "").strip() or None
    if config_file is not None:
        source = "--config" if args.config is not None else ENV_CONFIG_FILE
        layers.append(read_config_file(Path(config_file).expanduser(), source))
    layers.append(read_environment(env, settings))
    given = vars(args)
    layers.append(read_flags({setting: given[setting.dest] for setting in settings if setting.dest in given}))
    return merge_layers(*layers)


@contextlib.contextmanager
def values_checked() -> Iterator[None]:
    """Turn the ValueError of a config object built from flags into a usage error."""
    try:
        yield
    except ValueError as exc:
        raise UsageError(str(exc)) from None
