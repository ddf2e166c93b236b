"""``python -m attnzoo.cli ...``: the ``attnzoo`` command."""

import sys

from . import main

sys.exit(main())
