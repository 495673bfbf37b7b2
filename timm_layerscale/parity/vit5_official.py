"""The official-layout ViT-5 reference, now :mod:`timm_layerscale.families.vit5_official`; re-exported here."""

from ..families.vit5_official import Vit5Official, build_official_vit5

__all__ = ["Vit5Official", "build_official_vit5"]
