"""The offline demo: timm's ``cait_xxs24_224`` with seeded random weights saved as the official code saves
it, converted, verified against timm, exported as a Hub-ready folder and loaded back with timm."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .progress import write_out

__all__ = ["run_demo", "write_official_checkpoint"]

MODEL = "cait_xxs24_224_ls"
REFERENCE = "cait_xxs24_224"


def write_official_checkpoint(
    path: str | os.PathLike[str], model_name: str = REFERENCE, seed: int = 0, overwrite: bool = False
) -> Any:
    """Save a variant's reference with seeded weights (every parameter, gammas of std 0.1) in the layout ``gamma``
    names for a ``.pth`` file, in its container (the official ``{'model': {'module.' + key: tensor}}`` for CaiT;
    timm's layout for DINOv3); return the reference (eval mode).

    Args:
        path: The ``.pth`` file to write.
        model_name: A variant's name or its timm reference's (``cait_xxs24_224``).
        seed: Seed of the weights.
        overwrite: Replace an existing file.
    """
    from .conversion.rules import to_gamma
    from .families import VARIANTS, get_variant
    from .files.save import save_pth
    from .parity.inputs import seed_parameters_
    from .parity.references import build_reference

    variant = next((v for v in VARIANTS if model_name in (v.name, v.reference)), None) or get_variant(model_name)
    ref = seed_parameters_(build_reference(variant), seed)
    sd = to_gamma(ref.state_dict(), variant.family)
    save_pth(path, sd, overwrite=overwrite, wrap=variant.family.layouts[variant.family.alias("pth")].wrap)
    return ref.eval()


def run_demo(
    out: str | os.PathLike[str] = "demo-out", overwrite: bool = False, seed: int = 0, options: Any = None
) -> bool:
    """Run the demo into the folder ``out`` (written as an export is: an error leaves it as it was, a failed
    check keeps the outputs) with ``options`` for the verification; return whether every check held.

    Raises:
        OutputExistsError: ``out`` is not empty, without ``overwrite``.
    """
    import timm

    from . import models  # noqa: F401  (registers the models)
    from .errors import ParityError
    from .files.atomic import folder_output
    from .hub.export import export_folder
    from .parity.compare import compare_models
    from .parity.inputs import seeded_inputs

    t0, folder = time.perf_counter(), Path(out)
    hub = f"{MODEL}.fb_dist_in1k"
    with folder_output(folder, overwrite) as tmp:
        write_out(f"[1/3] writing a seeded {REFERENCE} in the official layout -> {folder / 'XXS24_224.pth'}")
        reference = write_official_checkpoint(tmp / "XXS24_224.pth", REFERENCE, seed=seed)
        write_out(f"[2/3] converting to the LayerScale-module layout, verifying against timm's {REFERENCE},")
        write_out(f"      and exporting a Hub-ready folder -> {folder / hub}")
        try:
            res = export_folder(tmp / "XXS24_224.pth", tmp / hub, options=options).conversion
        except ParityError as e:
            write_out(f"\n{e.report.format_table()}\n      {e}")
            res = None
    folder = folder.resolve()  # the folder itself, through links and ``..``
    ok = res is not None and res.report is not None and res.report.passed
    if res is not None and res.report is not None:
        write_out(f"      detected {res.variant.name}; source sha256 {res.source_sha256[:16]}...; {res.seconds:.1f} s")
        write_out("      wrote " + ", ".join(sorted(p.name for p in (folder / hub).iterdir())))
        write_out(f"\n{res.report.format_table()}\n")
        write_out("[3/3] loading the results with timm.create_model and comparing with the reference")
        inputs = seeded_inputs(4, 224, seed=seed + 1)
        file, local = {"file": str(folder / hub / "model.safetensors")}, f"local-dir:{folder / hub}"
        calls = [(f"'{MODEL}', pretrained=True, pretrained_cfg_overlay=dict(file=...)", MODEL, file)]
        for call, name, overlay in [*calls, (f"'{local}', pretrained=True", local, None)]:
            loaded = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay)
            rep = compare_models(
                reference,
                loaded,
                inputs,
                reference_name=REFERENCE,
                model_name=name,
                family=res.variant.family.name,
                inputs_desc="4 seeded images",
            )
            exact = "yes" if rep.bit_exact else "no"
            write_out(f"      timm.create_model({call}): bit-exact: {exact} (max abs diff {rep.max_abs_diff:.3g})")
            ok = ok and rep.passed
    write_out(f"\ndemo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s; outputs in {folder}/")
    return ok
