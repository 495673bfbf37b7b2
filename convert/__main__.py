"""``python -m convert``: run the release pipeline."""

import sys

from .release import main

sys.exit(main())
