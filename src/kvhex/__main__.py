"""``python -m kvhex``: the ``kvhex`` command."""

import sys

from kvhex.cli import main

sys.exit(main())
