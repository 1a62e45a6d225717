"""``python -m moebit.cli``: the same as the ``moebit`` command."""

import sys

from moebit.cli import main

sys.exit(main())
