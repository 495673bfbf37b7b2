"""``python -m timm_layerscale``: the command line."""

import sys

from .cli import main

sys.exit(main())
