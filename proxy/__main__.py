"""``python -m proxy serve ...``: the same as the ``streamproxy`` console script."""

import sys

from proxy.cli import main

sys.exit(main())
