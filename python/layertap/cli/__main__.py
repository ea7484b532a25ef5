"""``python -m layertap.cli``: the ``layertap`` command, as ``python -m layertap``."""

import sys

from layertap.cli import main

sys.exit(main())
