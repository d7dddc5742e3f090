"""``python -m neuron_remat``: the same as the ``neuron-remat`` command."""

import sys

from .cli import main

sys.exit(main())
