"""``python -m attnzoo ...``: the ``attnzoo`` command."""

import sys

from .cli import main

sys.exit(main())
