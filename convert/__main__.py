"""``python -m convert``: run the CaiT release pipeline."""

import sys

from .release_cait import main

sys.exit(main())
