"""Maintainers' release pipeline: every official CaiT checkpoint converted, verified, exported and uploaded.

``python -m convert --help`` (from the repository root) lists the options; the
table of checkpoints and the steps live in :mod:`convert.release_cait`.
"""

from .release_cait import RELEASES, Release, main

__all__ = ["RELEASES", "Release", "main"]
