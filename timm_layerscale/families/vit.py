"""What the Vision Transformer families share (CaiT, DeiT III, ViT-5, DINOv3, DINOv2, BEiT): a block's two gates as
timm's ``Block`` and the authors' files name them, and where a ViT's state dict keeps its width, grid and head."""

from __future__ import annotations

from typing import Any

from . import Gate

#: ``ls1`` scales the attention branch, ``ls2`` the MLP's; raw, they are ``gamma_1``/``gamma_2``.
GATES = (
    Gate("ls1", "attention", {"timm": "gamma_1", "official": "gamma_1"}, fold="attn.proj"),
    Gate("ls2", "MLP", {"timm": "gamma_2", "official": "gamma_2"}, fold="mlp.fc2"),
)
#: The ``Family`` fields of a ViT: its numbered ``blocks``, gates, patch embedding, position embedding and head.
VIT: dict[str, Any] = {
    "blocks": r"blocks\.\d+",
    "gates": GATES,
    "stem": "patch_embed.proj.weight",
    "positions": "pos_embed",
    "head": "head",
}
