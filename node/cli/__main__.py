"""`python -m node.cli`: the `murmur` command."""

import sys

from node.cli.main import main

sys.exit(main())
