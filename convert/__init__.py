"""Maintainers' release pipeline: every official CaiT, DeiT-III and ViT-5 checkpoint converted, verified, exported and uploaded.

``python -m convert --help`` (from the repository root) lists the options; the
table of releases and the steps live in :mod:`convert.release`.
"""

from .release import Release, main, releases

__all__ = ["Release", "main", "releases"]
