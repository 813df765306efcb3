"""`python -m node.config`: print the settings table for docs/cli.md."""

import sys

from node.config.docs import settings_table

sys.stdout.write(settings_table())
