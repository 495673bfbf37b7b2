"""Building blocks of the package's models, one idea per module."""

from .attention import MultiHeadAttention, SdpaAttention
from .block import PreNormBlock
from .class_attn import ClassAttn, LayerScaleBlockClassAttn
from .rope import Vit5RotaryEmbedding, apply_rope
from .rope_attention import Vit5Attention, Vit5Block
from .talking_heads import ATTN_IMPLS, BufferedTalkingHeadAttn, FastTalkingHeadAttn, TalkingHeadAttn

__all__ = [
    "ATTN_IMPLS",
    "BufferedTalkingHeadAttn",
    "ClassAttn",
    "FastTalkingHeadAttn",
    "LayerScaleBlockClassAttn",
    "MultiHeadAttention",
    "PreNormBlock",
    "SdpaAttention",
    "TalkingHeadAttn",
    "Vit5Attention",
    "Vit5Block",
    "Vit5RotaryEmbedding",
    "apply_rope",
]
