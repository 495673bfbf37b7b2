"""What the Vision Transformer families share (CaiT, DeiT III, ViT-5, DINOv3, DINOv2, BEiT): a block's two gates as
timm's ``Block`` and the authors' files name them, and where a ViT's state dict keeps its width, grid and head."""

from __future__ import annotations

from typing import Any

from . import Gate


def gates(*raw_in: str) -> tuple[Gate, Gate]:
    """A ViT block's two gates: ``ls1`` scales the attention branch, ``ls2`` the MLP's; in the layouts ``raw_in``
    names they are raw ``gamma_1``/``gamma_2``, in the others modules."""
    return (
        Gate("ls1", "attention", dict.fromkeys(raw_in, "gamma_1"), fold="attn.proj"),
        Gate("ls2", "MLP", dict.fromkeys(raw_in, "gamma_2"), fold="mlp.fc2"),
    )


#: The ``Family`` fields of a ViT: its numbered ``blocks``, patch embedding, position embedding and head.
VIT: dict[str, Any] = {
    "blocks": r"blocks\.\d+",
    "stem": "patch_embed.proj.weight",
    "positions": "pos_embed",
    "head": "head",
}
