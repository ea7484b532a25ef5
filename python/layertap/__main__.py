"""``python -m layertap``: the ``layertap`` command."""

import sys

from layertap.cli import main

sys.exit(main())
