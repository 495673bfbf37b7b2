"""Tensors and state dicts shared by the reading and writing tests."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path

import torch

ALL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def mixed_state_dict() -> dict[str, torch.Tensor]:
    return {
        "blocks.0.attn.qkv.weight": make_tensor((6, 4), torch.float32, 1),
        "blocks.0.gamma_1": make_tensor((4,), torch.bfloat16, 2),
        "blocks.0.gamma_2": make_tensor((4,), torch.float16, 3),
        "num_batches_tracked": torch.tensor(7),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
        "tokens": make_tensor((2, 3), torch.int64, 4),
        "é.unicode": make_tensor((3,), torch.float64, 5),
    }


def assert_same_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(
            a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
            b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k],
        ), k


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


def header_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + n]
