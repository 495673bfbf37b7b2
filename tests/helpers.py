"""What several test modules share: tensors and state dicts for the reading and writing tests,
the in-process command line and its one-line-error assertion."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from timm_layerscale.cli import main

M = TypeVar("M", bound=torch.nn.Module)

#: The repository's root.
ROOT = Path(__file__).resolve().parents[1]

#: Devices for tests that run where timm users run models: the CPU, and CUDA where present.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]

#: The prefix of every error line of the command line.
ERROR = "timm-layerscale: error: "

ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16]
ALL_DTYPES += [torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn]


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


def damage_inside(path: Path, tensor: torch.Tensor, size: int | None = None, fill: bytes = b"\0") -> None:
    """Overwrite the first ``size`` bytes (all by default) of ``tensor``'s storage where ``path``,
    a PyTorch file holding it, stores them: the file keeps its size and its zip's directory, so
    ``torch.load`` reads it, with other values."""
    data = bytearray(path.read_bytes())
    stored = bytes(tensor.untyped_storage())[:size]
    start = data.index(stored)
    data[start : start + len(stored)] = (fill * len(stored))[: len(stored)]
    path.write_bytes(data)


def header_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + n]


def safetensors_contents(path: Path) -> dict[str, Any]:
    """A safetensors file's metadata and, per tensor, its dtype tag, shape and bytes: what it holds,
    whatever the order and alignment of its data."""
    data, header = path.read_bytes(), header_bytes(path)
    start, entries = 8 + len(header), json.loads(header)
    out: dict[str, Any] = {"__metadata__": entries.pop("__metadata__", None)}
    for name, e in entries.items():
        begin, end = e["data_offsets"]
        out[name] = (e["dtype"], e["shape"], data[start + begin : start + end])
    return out


def assert_aligned(path: Path) -> None:
    """The data starts on a 64-byte boundary of the file, as does every tensor of whole 64-byte blocks;
    every other tensor starts on a multiple of its item size."""
    header = header_bytes(path)
    assert (8 + len(header)) % 64 == 0
    for name, e in json.loads(header).items():
        if name != "__metadata__":
            begin, end = e["data_offsets"]
            count = math.prod(e["shape"])
            assert begin % (64 if (end - begin) % 64 == 0 else (end - begin) // count) == 0, name


def run_python_into(stdout: int, *args: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` from the repository's root, with standard output the descriptor ``stdout``
    (closed afterwards) and without ``PYTHONUNBUFFERED``, as most users run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        return subprocess.run(
            [sys.executable, *args], stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
    finally:
        os.close(stdout)


def cli(capsys, *argv) -> tuple[int, str, str]:
    """Run ``timm-layerscale ARGV`` in this process: exit status, stdout, stderr."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(
    code: int, out: str, err: str, expect: str = "", status: int = 2, stdout: str | None = None
) -> str:
    """A user-facing failure: exit ``status``, one ``error:`` line naming ``expect``, no traceback."""
    assert code == status, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR), err
    assert expect in lines[0], err
    if stdout is not None:
        assert out == stdout, out
    return lines[0]


def randomize(model: M, seed: int = 0) -> M:
    """Every parameter random, in place; gammas with std 0.1 so that every branch matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if "gamma" in name else 0.05))
    return model


def fine_tuned(official: Path, path: Path, num_classes: int | None = 10, img_size: int | None = None) -> Path:
    """An official CaiT file as a fine-tuning run saves it: with a new seeded ``num_classes`` head
    (``0``: without a head, as a feature backbone is saved; ``None``: the head kept), and with the
    position grid of ``img_size`` where one is given."""
    obj = torch.load(official, map_location="cpu", weights_only=True)
    sd = obj["model"]
    g = torch.Generator().manual_seed(5)
    if num_classes == 0:
        del sd["module.head.weight"], sd["module.head.bias"]
    elif num_classes is not None:
        sd["module.head.weight"] = torch.randn(num_classes, sd["module.head.weight"].shape[1], generator=g) * 0.02
        sd["module.head.bias"] = torch.randn(num_classes, generator=g) * 0.02
    if img_size is not None:
        pos = sd["module.pos_embed"]
        sd["module.pos_embed"] = torch.randn(1, (img_size // 16) ** 2, pos.shape[2], generator=g) * 0.02
    torch.save(obj, path)
    return path


#: A CaiT small enough to run in milliseconds, with every feature of the real ones.
TINY_CAIT: dict[str, Any] = dict(
    img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, num_classes=10, init_values=1e-5
)
#: A ViT-5 of the same size class.
TINY_VIT5: dict[str, Any] = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)


def images(n: int, size: int, seed: int = 1) -> torch.Tensor:
    """``n`` seeded random images of ``size`` x ``size``."""
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def tiny_pair(attn_impl: str = "reference", **kwargs: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """timm's Cait and CaitLS of :data:`TINY_CAIT` (with ``kwargs``), the same random weights;
    ``attn_impl`` is CaitLS's attention mode."""
    from timm.models.cait import Cait

    from timm_layerscale import to_layerscale
    from timm_layerscale.models.cait_ls import CaitLS

    args = dict(TINY_CAIT, **kwargs)
    ref = randomize(Cait(**args)).eval()
    ours = CaitLS(**args, attn_impl=attn_impl).eval()
    ours.load_state_dict(to_layerscale(ref.state_dict(), "cait"), strict=True)
    return ref, ours


def create_model(name: str, **kwargs: Any) -> Any:
    """``timm.create_model`` typed as ``Any``, for tests that reach into a model's submodules."""
    import timm

    return timm.create_model(name, **kwargs)


def parity_report(
    passed: bool, reference: str = "cait_xxs24_224", model: str = "cait_xxs24_224_ls", **fields: Any
) -> Any:
    """A :class:`~timm_layerscale.parity.compare.ParityReport` of one image: bit-exact, or off by 0.5."""
    from timm_layerscale.parity.compare import ParityReport

    values: dict[str, Any] = dict(
        reference=reference,
        model=model,
        family="cait",
        inputs="1 image",
        num_inputs=1,
        dtype="float32",
        device="cpu",
        attention="manual",
        max_abs_diff=0.0 if passed else 0.5,
        max_rel_diff=0.0 if passed else 0.1,
        cosine_min=1.0 if passed else 0.99,
        top1_agreement=1.0,
        top5_agreement=1.0,
        bit_exact=passed,
        atol=0.0,
        rtol=0.0,
        passed=passed,
    )
    values.update(fields)
    return ParityReport(**values)


#: torch's (major, minor) version.
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])


def assert_traces_and_scripts(
    model: Any, x: torch.Tensor, features: torch.nn.Module, dynamic_batch: bool = True, dynamic_size: bool = True
) -> None:
    """timm's FX feature extractor, ``torch.jit.script``, the script of the FX graph and
    ``torch.export`` give the eval-mode ``model``'s eager outputs, on ``x``'s device (both modules
    are moved there). With ``dynamic_batch`` the program is exported with a dynamic batch size
    (and, from torch 2.8 and with ``dynamic_size``, height and width for a ``dynamic_img_size`` model) and also run
    at other ones."""
    import warnings

    import timm

    model, features = model.to(x.device), features.to(x.device)
    kept: list[torch.Tensor] = []
    with torch.no_grad():
        hook = model.blocks[1].register_forward_hook(lambda module, args, out: kept.append(out))
        expected = model(x)
        hook.remove()
        extractor = timm.models.create_feature_extractor(model, return_nodes=["blocks.1", "head"])
        traced = extractor(x)
        with warnings.catch_warnings(), torch.jit.optimized_execution(False):
            warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", FutureWarning)
            scripted = torch.jit.script(model)(x)
            scripted_graph = torch.jit.script(extractor)(x)
        feature_maps = features(x)
        dims, more = None, x
        if dynamic_batch:
            dims, more = {0: torch.export.Dim("batch", min=2, max=16)}, torch.cat([x, x[:1]])
            if (
                dynamic_size and model.dynamic_img_size and TORCH_VERSION >= (2, 8)
            ):  # before, timm's patch check fixes the size
                p = model.patch_embed.patch_size[0]
                dims.update({2: p * torch.export.Dim("h", min=2, max=16), 3: p * torch.export.Dim("w", min=2, max=16)})
                size = (3, x.shape[1], x.shape[2] + p, x.shape[3] + 2 * p)
                more = torch.randn(size, generator=torch.Generator().manual_seed(1)).to(x.device)
        exported = torch.export.export(model, (x,), dynamic_shapes={"x": dims} if dims else None).module()
        exported_ok = torch.equal(exported(x), expected) and torch.equal(exported(more), model(more))
    assert exported_ok, "torch.export's program differs from the eager model"
    assert torch.equal(traced["head"], expected) and torch.equal(traced["blocks.1"], kept[0])
    assert torch.equal(scripted, expected) and torch.equal(scripted_graph["head"], expected)
    assert [f.shape for f in feature_maps] == [kept[0].shape]


def detected(checkpoint: Any, model: str | None = None) -> Any:
    """The :class:`~timm_layerscale.conversion.detect.Detection` of a checkpoint (wrapped or not)."""
    from timm_layerscale.conversion.checkpoint import container_of, state_dict_of
    from timm_layerscale.conversion.detect import detect

    return detect(state_dict_of(checkpoint), model, container_of(checkpoint))


def gamma_file(state_dict: Mapping[str, Any], family: Any) -> dict[str, Any]:
    """``state_dict`` (in the layout ``gamma`` names for a ``.pth``) in that layout's container, as its release file
    holds it (``{'model': {'module.' + key: tensor}}`` for CaiT)."""
    from timm_layerscale.families import get_family

    fam = get_family(family) if isinstance(family, str) else family
    return fam.layouts[fam.alias("pth")].wrap(state_dict)


def tiny_twins(family: str) -> tuple[Any, Any]:
    """A family's tiny timm model (``tinytest_<family>``, ``tests/tiny_models.py``) with random weights and gates, and
    this package's tiny model (``tinytest_<family>_ls``) loaded from its state dict by the rules."""
    import timm

    import tiny_models  # noqa: F401  (registers them)
    from timm_layerscale.conversion.rules import to_layerscale

    ref = randomize(timm.create_model(f"tinytest_{family}")).eval()
    ours = timm.create_model(f"tinytest_{family}_ls").eval()
    ours.load_state_dict(to_layerscale(ref.state_dict(), family))
    return ref, ours


def assert_computes_as_its_twin(ref: Any, ours: Any, family: str, size: int) -> None:
    """``ours`` computes ``ref``'s function bit for bit on ``size`` x ``size`` images: batch 1 and 3, fused attention
    on and off, bf16 autocast, ``forward_intermediates``, compiled; and a training step's gradients."""
    from timm_layerscale.conversion.rules import to_layerscale

    for batch in (1, 3):
        x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            for fused in (True, False):
                for m in (m for model in (ref, ours) for m in model.modules() if hasattr(m, "fused_attn")):
                    m.fused_attn = fused
                assert torch.equal(ours.forward_features(x), ref.forward_features(x)) and torch.equal(ours(x), ref(x))
            with torch.autocast("cpu", torch.bfloat16):
                assert torch.equal(ours(x), ref(x))
    with torch.no_grad():
        final, inter = ours.forward_intermediates(x, indices=1)
        want_final, want_inter = ref.forward_intermediates(x, indices=1)
        assert torch.equal(final, want_final) and all(map(torch.equal, inter, want_inter))
        torch._dynamo.reset()
        assert torch.equal(torch.compile(ours, backend="aot_eager")(x), torch.compile(ref, backend="aot_eager")(x))
    ref.train()(x).square().mean().backward()
    ours.train()(x).square().mean().backward()
    grads = {k: p.grad for k, p in ours.named_parameters()}
    for key, p in to_layerscale(dict(ref.named_parameters()), family).items():
        assert torch.equal(grads[key], p.grad), key
