"""The compatibility matrix: the test subset against the oldest and newest supported timm and torch (``python -m compat``)."""
