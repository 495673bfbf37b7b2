"""The parity net: what varies between users, sampled in one fresh interpreter."""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import timm
from timm.layers import set_fused_attn

from timm_layerscale.families import get_variant
from timm_layerscale.parity.references import load_model
from timm_layerscale.parity.tolerance import VerifyOptions, independent_bound

#: (family, converted model) at the sizes the net samples; the references are timm's
#: ``cait_xxs24_224`` and ``deit3_small_patch16_224``.
MODELS = [("cait", "cait_xxs24_224_ls"), ("deit3", "deit3_small_patch16_224")]
VIT5 = "vit5_small_patch16_224"
OFFSETS = range(0, 64, 8)  # where the converted data starts, mod 64 (the full scope's verify route takes 0 and 8)
BATCHES = (1, 2, 3, 5)  # the full scope's; the core scope samples 1 and 3


def write_at_offset(src: Path, dst: Path, offset: int) -> Path:
    """Copy a safetensors file with its header padded so that its data starts at ``offset`` mod 64."""
    raw = src.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8 : 8 + n].rstrip(b" ")
    header += b" " * ((offset - 8 - len(header)) % 64)
    with dst.open("wb") as f:
        f.writelines([struct.pack("<Q", len(header)), header, memoryview(raw)[8 + n :]])
    return dst


#: Where both models run: ``sys.argv[2]``.
DEVICE = "cpu"


def prepare(workdir: Path) -> Path:
    """Official-layout files of the three families, their conversions, and exported CaiT and DeiT-III folders."""
    from timm_layerscale.converter import convert_checkpoint
    from timm_layerscale.demo import write_official_checkpoint
    from timm_layerscale.hub.export import export_folder

    workdir.mkdir(parents=True, exist_ok=True)
    for family, name in [("cait", "cait_xxs24_224"), ("deit3", "deit3_small_patch16_224"), ("vit5", VIT5)]:
        write_official_checkpoint(workdir / f"{family}.pth", name, seed=3)
        convert_checkpoint(workdir / f"{family}.pth", workdir / f"{family}.safetensors", verify=False)
        if family != "vit5":
            options = VerifyOptions(num_inputs=1)
            export_folder(workdir / f"{family}.pth", workdir / f"{family}-export", plot=False, options=options)
    return workdir


def images(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(seed + batch)).to(DEVICE)


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if torch.equal(a, b):
        return 0.0
    return max((a.float() - b.float()).abs().max().item(), 1e-45)


def grad_mode(name: str) -> contextlib.AbstractContextManager[Any]:
    return {"inference_mode": torch.inference_mode(), "no_grad": torch.no_grad(), "grad": torch.enable_grad()}[name]


def autocast(dtype: str) -> contextlib.AbstractContextManager[Any]:
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(
        torch.device(DEVICE).type, dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
    )


@contextlib.contextmanager
def fused_attention(on: bool) -> Iterator[None]:
    """timm's fused-attention setting for the models built inside (read at construction)."""
    set_fused_attn(on)
    try:
        yield
    finally:
        set_fused_attn(True)


class Net:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.results: dict[str, float] = {}
        self.verdicts: dict[str, bool] = {}
        self.built: dict[tuple[str, bool], dict[str, torch.nn.Module]] = {}

    def compare(
        self,
        cases: dict[str, torch.nn.Module],
        ref: torch.nn.Module,
        batch: int,
        mode: str,
        dtype: str,
        channels_last: bool = False,
    ) -> None:
        """Each model of ``cases`` (case name -> model) against one forward pass of ``ref``."""
        x = images(batch)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
            ref = copy.deepcopy(ref).to(memory_format=torch.channels_last)
        with grad_mode(mode), autocast(dtype):
            expected = ref(x)
            for case, model in cases.items():
                if channels_last:
                    model = copy.deepcopy(model).to(memory_format=torch.channels_last)
                self.results[case] = diff(expected, model(x))

    def reference(self, family: str, name: str) -> torch.nn.Module:
        """timm's reference model (``cait_*``, ``deit3_*``) on the official file, loaded from the zip."""
        from timm_layerscale.files.read import read_checkpoint

        v = get_variant(name)
        return load_model(v, v.family.layout("gamma"), read_checkpoint(self.workdir / f"{family}.pth")[1]).to(DEVICE)

    def from_file(self, name: str, file: Path, **kwargs: Any) -> torch.nn.Module:
        overlay = dict(file=str(file))
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs).to(DEVICE).eval()

    def from_folder(self, folder: Path) -> torch.nn.Module:
        return timm.create_model(f"local-dir:{folder}", pretrained=True).to(DEVICE).eval()

    def offsets(self, family: str, name: str, offsets: Any, routes: tuple[str, ...]) -> None:
        """Each route at each offset of the converted data, at batch size 1 (a one-row GEMM in class attention)."""
        from timm_layerscale.converter import verify_checkpoint

        ref = self.models(family, name, True)["ref"]
        for off in offsets:
            tmp = self.workdir / f"off{off}"
            tmp.mkdir(exist_ok=True)
            try:
                file = write_at_offset(self.workdir / f"{family}.safetensors", tmp / "model.safetensors", off)
                if "verify" in routes and off in (0, 8):  # it computes on fresh copies: 8 mod 16 stands for all
                    options = VerifyOptions(num_inputs=1, batch_size=1, device=DEVICE)
                    report = verify_checkpoint(self.workdir / f"{family}.pth", file, options=options)
                    self.results[f"{family} verify offset {off}"] = 0.0 if report.bit_exact else report.max_abs_diff
                models = {}
                if "file" in routes:
                    models[f"{family} create_model(file) offset {off}"] = self.from_file(name, file)
                if "local-dir" in routes:
                    folder, export = tmp / "folder", self.workdir / f"{family}-export"
                    folder.mkdir()
                    shutil.copy(export / "config.json", folder / "config.json")
                    write_at_offset(export / "model.safetensors", folder / "model.safetensors", off)
                    models[f"{family} local-dir offset {off}"] = self.from_folder(folder)
                self.compare(models, ref, 1, "inference_mode", "fp32")
            finally:
                shutil.rmtree(tmp)

    def models(self, family: str, name: str, fused: bool) -> dict[str, torch.nn.Module]:
        """timm's reference, the converted model and (CaiT) its buffered attention, built once per process."""
        key, file = (family, fused), self.workdir / f"{family}.safetensors"
        if key not in self.built:
            with fused_attention(fused):
                built = {"ref": self.reference(family, name), "": self.from_file(name, file)}
                if family == "cait":
                    built["buffered "] = self.from_file(name, file, attn_impl="buffered")
            self.built[key] = built
        return self.built[key]

    def matrix(self, family: str, name: str, full: bool) -> None:
        """Fused attention on with batch sizes, grad modes and autocast dtypes; off with the batch sizes."""
        batches = BATCHES if full else (1, 3)
        cases = [("inference_mode", "fp32", b, False) for b in batches] + [("inference_mode", "bf16", 1, False)]
        if full:
            cases += [("no_grad", "fp32", 1, False), ("grad", "fp32", 3, False), ("inference_mode", "bf16", 3, False)]
            cases += [("grad", "bf16", 1, False), ("inference_mode", "fp16", 1, False), ("grad", "fp16", 2, False)]
            cases += [("inference_mode", "fp32", 3, True), ("inference_mode", "bf16", 2, True)]
        for fused in (True, False):
            built = self.models(family, name, fused)
            for mode, dtype, batch, channels_last in cases if fused else cases[: len(batches) + 1]:
                setting = f"{mode} {dtype} b{batch}" + (" channels_last" if channels_last else "")
                models = {  # the buffered attention is an fp32 inference path
                    f"{family} {kind}fused_attn={fused} {setting}": m
                    for kind, m in built.items()
                    if kind != "ref" and (kind == "" or dtype == "fp32")
                }
                self.compare(models, built["ref"], batch, mode, dtype, channels_last)

    def vit5(self) -> None:
        """ViT-5 aligned and not: within the stated tolerance, and one ``--exact`` verdict."""
        from timm_layerscale.converter import verify_checkpoint

        for off in (8,):  # verification computes on fresh copies, at any offset of the file
            tmp = self.workdir / f"vit5-off{off}.safetensors"
            write_at_offset(self.workdir / "vit5.safetensors", tmp, off)
            try:
                for exact in (False, True):
                    options = VerifyOptions(num_inputs=1, batch_size=1, exact=exact, device=DEVICE)
                    report = verify_checkpoint(self.workdir / "vit5.pth", tmp, options=options)
                    self.verdicts[f"vit5 verify offset {off} exact={exact}"] = report.passed
            finally:
                tmp.unlink()
        self.vit5_autocast()

    def vit5_autocast(self) -> None:
        """ViT-5 against its reference under bf16 and fp16 autocast, within the independent bound of that dtype."""
        from timm_layerscale.conversion.rules import to_layerscale
        from timm_layerscale.files.read import read_checkpoint

        sd = read_checkpoint(self.workdir / "vit5.pth")[1]
        v = get_variant(VIT5)
        ref = load_model(v, v.family.layout("gamma"), sd).to(DEVICE)
        model = load_model(v, v.family.layouts["ls"], to_layerscale(sd, "vit5")).to(DEVICE)
        for m in model.modules():  # the reference attends by hand
            if hasattr(m, "fused_attn"):
                setattr(m, "fused_attn", False)  # noqa: B010
        x = images(3)
        for dtype in ("bf16", "fp16"):
            for mode in ("inference_mode", "grad"):
                with grad_mode(mode), autocast(dtype):
                    expected, got = ref(x), model(x)
                bound = independent_bound(12, 384, expected.dtype)  # ViT-5 small
                ok = torch.allclose(got.float(), expected.float(), atol=bound, rtol=bound)
                self.verdicts[f"vit5 autocast {dtype} {mode} within tolerance"] = ok


def run(net: Net, scope: str) -> dict[str, Any]:
    """One setting's cases: ``full`` samples the three families, ``core`` CaiT's matrix and two offsets."""
    net.results, net.verdicts = {}, {}
    full = scope == "full"
    # DeiT-III's converted model is timm's own class, so under the other settings that would only
    # compare timm with itself: it is sampled at the default ones, CaiT under every setting.
    for family, name in [m for m in MODELS if full or m[0] == "cait"]:
        net.matrix(family, name, full and family == "cait")  # DeiT-III's matrix compares timm's class with itself
        routes = ("verify", "file", "local-dir") if full else ("file",)
        net.offsets(family, name, OFFSETS if full else (0, 8), routes)
    if full:
        net.vit5()
    return {
        "threads": torch.get_num_threads(),
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "results": net.results,
        "vit5_verdicts": net.verdicts,
    }


def main(workdir: Path, settings: list[str]) -> dict[str, Any]:
    """Each of ``settings`` (``SCOPE:THREADS:PRECISION``, THREADS ``default`` or a count) in turn, in this
    interpreter: the models are built once, the thread count and matmul precision set per setting."""
    net, default_threads, runs = Net(workdir), torch.get_num_threads(), {}
    for setting in settings:
        scope, threads, precision = setting.split(":")
        torch.set_num_threads(default_threads if threads == "default" else int(threads))
        torch.set_float32_matmul_precision(precision)
        runs[setting] = run(net, scope)
    capability = torch.cuda.get_device_name() if DEVICE == "cuda" else torch.backends.cpu.get_cpu_capability()
    return {"capability": capability, "runs": runs}


if __name__ == "__main__":
    work, DEVICE = Path(sys.argv[1]), sys.argv[2]
    print(json.dumps(main(work if work.exists() else prepare(work), sys.argv[3:])))
