"""Exact-parity checks of the buffered CaiT attention alone (the model is the parity net's), in a fresh interpreter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timm.models.cait import TalkingHeadAttn as RefAttn

from helpers import randomize
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


if __name__ == "__main__":
    torch.set_num_threads(2)
    result = {"capability": torch.backends.cpu.get_cpu_capability(), "checks": attention_checks()}
    print(json.dumps(result))
