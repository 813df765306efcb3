"""Why a node cannot start: the one error the runtime's start-up reports as a line and exit status 2."""


class StartupError(Exception):
    """The node cannot start (identity in use, address in use, no swarm config...): one line, exit 2."""


class BootstrapUnreachable(StartupError):
    """None of the bootstrap peers (--peers) answered: the guided join says which and what to check."""
