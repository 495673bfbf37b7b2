"""Building blocks of the package's models, one idea per module."""
from .talking_heads import ATTN_IMPLS, BufferedTalkingHeadAttn, FastTalkingHeadAttn, TalkingHeadAttn

__all__ = ["ATTN_IMPLS", "BufferedTalkingHeadAttn", "FastTalkingHeadAttn", "TalkingHeadAttn"]
