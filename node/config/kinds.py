"""Value kinds: how one setting is read from text (environment, flags) and from TOML, and checked.

Each kind raises ValueError saying what is wrong; the caller adds where the value came from.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from multiaddr import Multiaddr

# The default listen address, and the example multiaddr errors suggest.
LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"


class Kind(Protocol):
    """Parses and checks one kind of value; raises ValueError saying what is wrong (without the source)."""

    @property
    def metavar(self) -> str: ...

    @property
    def description(self) -> str: ...  # for the docs table

    def from_text(self, text: str) -> object: ...

    def from_toml(self, raw: object) -> object: ...

    def check(self, value: object) -> None: ...


def toml_type(raw: object) -> str:
    """How a TOML value's type reads in an error ("an integer", "a table")."""
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array", dict: "a table"}
    return names.get(type(raw), type(raw).__name__)


def _toml_string(raw: object, expected: str = "a string") -> str:
    if not isinstance(raw, str):
        raise ValueError(f"must be {expected}, got {toml_type(raw)} ({raw!r})")
    return raw


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Integer:
    lo: int
    hi: int | None = None
    noun: str = "value"
    metavar: str = "N"

    @property
    def description(self) -> str:
        return f"integer {self.lo}-{self.hi}" if self.hi is not None else f"integer >= {self.lo}"

    def from_text(self, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        self.check(value)
        return value

    def from_toml(self, raw: object) -> int:
        if not _is_int(raw):
            raise ValueError(f"must be an integer, got {toml_type(raw)} ({raw!r})")
        self.check(raw)
        return raw  # type: ignore[return-value]

    def check(self, value: object) -> None:
        if not _is_int(value):
            raise ValueError(f"must be an integer, got {value!r}")
        if value < self.lo or (self.hi is not None and value > self.hi):  # type: ignore[operator]
            limits = f"out of range {self.lo}-{self.hi}" if self.hi is not None else f"below the minimum {self.lo}"
            raise ValueError(f"{self.noun} {value} is {limits}")


@dataclass(frozen=True)
class Number:
    """A finite float in (lo, hi) with each end open or closed."""

    lo: float
    lo_open: bool = False
    hi: float | None = None
    hi_open: bool = False
    metavar: str = "X"

    @property
    def description(self) -> str:
        low = f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"number {low}" + (f" and {'<' if self.hi_open else '<='} {self.hi:g}" if self.hi is not None else "")

    def from_text(self, text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        self.check(value)
        return value

    def from_toml(self, raw: object) -> float:
        if not isinstance(raw, (int, float)) or isinstance(raw, bool):
            raise ValueError(f"must be a number, got {toml_type(raw)} ({raw!r})")
        self.check(float(raw))
        return float(raw)

    def check(self, value: object) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value!r}")
        too_low = value <= self.lo if self.lo_open else value < self.lo
        too_high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if too_low or too_high:
            raise ValueError(f"{value:g} is out of range: must be a {self.description}")


@dataclass(frozen=True)
class Choice:
    noun: str
    choices: tuple[str, ...]
    upper: bool = False  # compare case-insensitively, stored upper-case (log levels)
    metavar: str = "NAME"

    @property
    def description(self) -> str:
        return " | ".join(self.choices)

    def from_text(self, text: str) -> str:
        value = text.strip().upper() if self.upper else text.strip()
        self.check(value)
        return value

    def from_toml(self, raw: object) -> str:
        return self.from_text(_toml_string(raw))

    def check(self, value: object) -> None:
        if value not in self.choices:
            raise ValueError(f"unknown {self.noun} {value!r}; choose one of {', '.join(self.choices)}")


@dataclass(frozen=True)
class Text:
    """A non-empty string without whitespace (names, host names); deeper checks are in `check_environment`."""

    metavar: str = "NAME"
    description: str = "string"

    def from_text(self, text: str) -> str:
        self.check(text)
        return text

    def from_toml(self, raw: object) -> str:
        return self.from_text(_toml_string(raw))

    def check(self, value: object) -> None:
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise ValueError(f"{value!r} must be a non-empty string without spaces")


@dataclass(frozen=True)
class PathKind:
    metavar: str = "PATH"
    description: str = "path"

    def from_text(self, text: str) -> Path:
        if not text.strip():
            raise ValueError("the path is empty")
        return Path(text).expanduser()

    def from_toml(self, raw: object) -> Path:
        return self.from_text(_toml_string(raw, "a string (a path)"))

    def check(self, value: object) -> None:
        if not isinstance(value, Path):
            raise ValueError(f"must be a pathlib.Path, got {value!r}")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Boolean:
    metavar: str = "BOOL"
    description: str = "boolean (env: 1/0, true/false, yes/no, on/off)"

    def from_text(self, text: str) -> bool:
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise ValueError(f"{text!r} is not a boolean; use one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")

    def from_toml(self, raw: object) -> bool:
        if not isinstance(raw, bool):
            raise ValueError(f"must be true or false, got {toml_type(raw)} ({raw!r})")
        return raw

    def check(self, value: object) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"must be a boolean, got {value!r}")


_ADDRESS_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


def check_multiaddr(text: str, *, peer: bool) -> None:
    """A multiaddr p2pd can listen on / announce (peer=False: no /p2p part) or dial as an initial
    peer (peer=True: ends in /p2p/<peer id>); raises ValueError saying what is wrong."""
    if not isinstance(text, str) or not text.startswith("/"):
        raise ValueError(f"malformed multiaddr {text!r}: it must start with '/', e.g. {LOOPBACK_LISTEN}")
    try:
        names = [protocol.name for protocol in Multiaddr(text).protocols()]
    except Exception as exc:  # the multiaddr package raises several exception types
        raise ValueError(f"malformed multiaddr {text!r}: {getattr(exc, 'message', exc)}") from None
    if not names:
        raise ValueError(f"malformed multiaddr {text!r}: it names no protocol")
    if peer and names == ["dnsaddr", "p2p"]:
        return  # resolved by p2pd through DNS TXT records
    if names[0] not in _ADDRESS_PROTOCOLS:
        raise ValueError(f"multiaddr {text!r} must start with an address: /{', /'.join(_ADDRESS_PROTOCOLS)}")
    if "tcp" not in names and "udp" not in names:
        raise ValueError(f"multiaddr {text!r} has no /tcp/<port> or /udp/<port>")
    if peer and names[-1] != "p2p":
        raise ValueError(f"peer multiaddr {text!r} must end with /p2p/<peer id>")
    if not peer and "p2p" in names:
        raise ValueError(f"multiaddr {text!r} must not name a peer (/p2p/...): it is this node's own address")


@dataclass(frozen=True)
class Multiaddrs:
    """A list of multiaddrs: repeated flags, a space- or comma-separated env value, a TOML array."""

    peer: bool
    metavar: str = "MULTIADDR"

    @property
    def description(self) -> str:
        return "list of peer multiaddrs (.../p2p/<peer id>)" if self.peer else "list of multiaddrs"

    def from_text(self, text: str) -> tuple[str, ...]:
        value = tuple(part for part in re.split(r"[\s,]+", text) if part)
        self.check(value)
        return value

    def from_toml(self, raw: object) -> tuple[str, ...]:
        if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
            raise ValueError(f"must be an array of strings, got {toml_type(raw)} ({raw!r})")
        value = tuple(raw)
        self.check(value)
        return value

    def check(self, value: object) -> None:
        if not isinstance(value, tuple):
            raise ValueError(f"must be a tuple of multiaddrs, got {value!r}")
        for item in value:
            check_multiaddr(item, peer=self.peer)


@dataclass(frozen=True)
class EdgeList:
    """Edges of the custom topology: "0-1,1-2,2-0" as text, [[0, 1], [1, 2]] (or the text) in TOML."""

    metavar: str = "EDGES"
    description: str = "edge list, e.g. 0-1,1-2,2-0"

    def from_text(self, text: str) -> tuple[tuple[int, int], ...]:
        try:
            edges = tuple(tuple(int(r) for r in pair.split("-")) for pair in text.split(",") if pair.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an edge list like 0-1,1-2,2-0") from None
        if any(len(edge) != 2 for edge in edges):
            raise ValueError(f"{text!r} is not an edge list like 0-1,1-2,2-0")
        self.check(edges)
        return edges  # type: ignore[return-value]

    def from_toml(self, raw: object) -> tuple[tuple[int, int], ...]:
        if isinstance(raw, str):
            return self.from_text(raw)
        if not isinstance(raw, list) or not all(
            isinstance(edge, list) and len(edge) == 2 and all(_is_int(r) for r in edge) for edge in raw
        ):
            raise ValueError(f"must be an array of [from, to] rank pairs or a string like \"0-1,1-2\", got {raw!r}")
        edges = tuple((edge[0], edge[1]) for edge in raw)
        self.check(edges)
        return edges

    def check(self, value: object) -> None:
        if not isinstance(value, tuple) or not all(
            isinstance(edge, tuple) and len(edge) == 2 and all(_is_int(r) and r >= 0 for r in edge) for edge in value
        ):
            raise ValueError(f"must be a tuple of (from, to) pairs of non-negative ranks, got {value!r}")


@dataclass(frozen=True)
class Named:
    """A name that must match `pattern` in full (models, devices); text is stripped of spaces."""

    noun: str
    pattern: str
    hint: str  # what the error suggests instead
    description: str
    metavar: str = "NAME"

    def from_text(self, text: str) -> str:
        value = text.strip()
        self.check(value)
        return value

    def from_toml(self, raw: object) -> str:
        return self.from_text(_toml_string(raw))

    def check(self, value: object) -> None:
        if not (isinstance(value, str) and re.fullmatch(self.pattern, value)):
            raise ValueError(f"unknown {self.noun} {value!r}; use {self.hint}")

