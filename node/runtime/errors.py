"""Why a node cannot start: the one error the runtime's start-up reports as a line and exit status 2."""


class StartupError(Exception):
    """The node cannot start (identity in use, address in use, no swarm config...): one line, exit 2."""
