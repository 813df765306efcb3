"""The node's settings: dataclasses, value kinds, the file < environment < flag layers and machine checks."""

from node.config.settings import *  # noqa: F403  (split into modules by the house issue)
