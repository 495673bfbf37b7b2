"""Exact-parity checks of the buffered CaiT attention, run in a fresh interpreter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import timm
from timm.layers import set_fused_attn
from timm.models.cait import TalkingHeadAttn as RefAttn

import timm_layerscale  # noqa: F401
from helpers import randomize
from timm_layerscale import to_layerscale
from timm_layerscale.models.cait_ls import BufferedTalkingHeadAttn

SHAPES = [(2, 17, 32, 4), (3, 50, 96, 6), (1, 65, 256, 16), (4, 196, 192, 4)]


def attention_checks() -> dict[str, bool]:
    out = {}
    for B, N, C, H in SHAPES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            ref = randomize(RefAttn(C, num_heads=H, qkv_bias=True)).eval().to(dtype)
            ours = BufferedTalkingHeadAttn(C, num_heads=H, qkv_bias=True).eval().to(dtype)
            ours.load_state_dict(ref.state_dict())
            x = torch.randn(B, N, C, generator=torch.Generator().manual_seed(N)).to(dtype)
            with torch.inference_mode():
                out[f"attention {B}x{N}x{C} H{H} {str(dtype)[6:]}"] = torch.equal(ref(x), ours(x))
    return out


def model_checks() -> dict[str, bool]:
    out = {}
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    for fused in (True, False):
        set_fused_attn(fused)
        ref = randomize(timm.create_model("cait_xxs24_224")).eval()
        ours = timm.create_model("cait_xxs24_224_ls", attn_impl="buffered").eval()
        ours.load_state_dict(to_layerscale(ref.state_dict(), "cait"), strict=True)
        with torch.inference_mode():
            out[f"cait_xxs24_224 fp32 fused_attn={fused}"] = torch.equal(ref(x), ours(x))
    return out


if __name__ == "__main__":
    torch.set_num_threads(2)
    result = {"capability": torch.backends.cpu.get_cpu_capability(), "checks": {**attention_checks(), **model_checks()}}
    print(json.dumps(result))
