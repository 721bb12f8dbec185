"""``python -m sqla_queue …`` is the ``sqla-queue`` command, for environments without its script."""

import sys

from .cli import main

sys.exit(main())
