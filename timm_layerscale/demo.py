"""The offline demo: the whole pipeline on a checkpoint written in the official layout.

1. Build timm's ``cait_xxs24_224`` with seeded random weights (every parameter,
   gammas of std 0.1) and save it exactly as the official training code does:
   ``{'model': {'module.' + key: tensor}}`` in a ``.pth`` file.
2. Convert it to the LayerScale-module layout, verify parity against timm's
   ``cait_xxs24_224``, and export a Hub-ready folder (``model.safetensors``,
   ``config.json``, model card, gate plot).
3. Load the results with ``timm.create_model`` (the file, and ``local-dir:``) and
   compare with the reference.

Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .progress import write_out

__all__ = ["run_demo", "write_official_checkpoint"]

MODEL = "cait_xxs24_224_ls"
REFERENCE = "cait_xxs24_224"


def run_demo(
    out: str | os.PathLike[str] = "demo-out", overwrite: bool = False, seed: int = 0, options: Any = None
) -> bool:
    """Run the demo into folder ``out``; return whether every parity check held.

    ``options`` (:class:`~timm_layerscale.parity.tolerance.VerifyOptions`) set the verification of step 2.
    A failed check prints its report and ends the demo with a ``demo FAILED`` line, its
    outputs kept; an error (a full disk, say) removes ``out`` again.

    Raises:
        OutputExistsError: ``out`` exists and is not empty, without ``overwrite``.
        CheckpointError: ``out`` is a file, or cannot be created or written.
    """
    from .errors import CheckpointError
    from .files.atomic import check_output_folder, clear_folder

    out = check_output_folder(Path(out), overwrite)
    existed = out.is_dir()
    try:
        if existed:  # emptied, not removed: it may be a mount point
            clear_folder(out)
        else:
            out.mkdir(parents=True)
    except OSError as e:
        what = "empty" if existed else "create"
        raise CheckpointError(f"cannot {what} {out} ({e.strerror or e}); choose another folder") from None
    try:
        return _run_steps(out, seed, options)
    except BaseException:  # an error, not a failed check: leave no partial folder
        if existed:  # the folder the user named stays, empty
            with contextlib.suppress(OSError):
                clear_folder(out)
        else:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _run_steps(out: Path, seed: int, options: Any) -> bool:
    t0 = time.perf_counter()

    import timm

    from . import models  # noqa: F401  (registers the models)
    from .errors import ParityError
    from .hub.export import export_folder
    from .parity.compare import compare_models
    from .parity.inputs import seeded_inputs

    def finish(ok: bool) -> bool:
        write_out("")
        write_out(f"demo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s; outputs in {out}/")
        return ok

    official = out / "XXS24_224.pth"
    write_out(f"[1/3] writing a seeded {REFERENCE} in the official layout -> {official}")
    reference = write_official_checkpoint(official, REFERENCE, seed=seed)

    hub_dir = out / f"{MODEL}.fb_dist_in1k"
    write_out(f"[2/3] converting to the LayerScale-module layout, verifying against timm's {REFERENCE},")
    write_out(f"      and exporting a Hub-ready folder -> {hub_dir}")
    try:
        exp = export_folder(official, hub_dir, overwrite=True, options=options)
    except ParityError as e:
        write_out("")
        write_out(e.report.format_table())
        write_out(f"      {e}")
        return finish(False)
    res = exp.conversion
    converted = hub_dir / "model.safetensors"
    write_out(f"      detected {res.variant.name}; source sha256 {res.source_sha256[:16]}...; {res.seconds:.1f} s")
    write_out("      wrote " + ", ".join(sorted(p.name for p in hub_dir.iterdir())))
    assert res.report is not None
    write_out("")
    write_out(res.report.format_table())
    write_out("")
    ok = res.report.passed

    write_out("[3/3] loading the results with timm.create_model and comparing with the reference")
    inputs = seeded_inputs(4, 224, seed=seed + 1)
    for call, name, overlay in (
        (f"'{MODEL}', pretrained=True, pretrained_cfg_overlay=dict(file=...)", MODEL, {"file": str(converted)}),
        (f"'local-dir:{hub_dir}', pretrained=True", f"local-dir:{hub_dir}", None),
    ):
        loaded = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay)
        rep = compare_models(
            reference,
            loaded,
            inputs,
            reference_name=REFERENCE,
            model_name=name,
            family="cait",
            inputs_desc="4 seeded images",
        )
        write_out(
            f"      timm.create_model({call}): "
            f"bit-exact: {'yes' if rep.bit_exact else 'no'} (max abs diff {rep.max_abs_diff:.3g})"
        )
        ok = ok and rep.passed
    return finish(ok)


def write_official_checkpoint(
    path: str | os.PathLike[str], model_name: str = "cait_xxs24_224", seed: int = 0, overwrite: bool = False
) -> Any:
    """Build a variant's reference model with seeded weights and save it in the official layout.

    Every parameter is random (:func:`~timm_layerscale.parity.inputs.seed_parameters_`,
    gammas of std 0.1), so that a layout or math error shows in the outputs.

    Args:
        path: The ``.pth`` file to write.
        model_name: A variant's name (``deit3_small_patch16_224``, ``vit5_small_patch16_224``)
            or its timm reference's (``cait_xxs24_224``).
        seed: Seed of the weights.
        overwrite: Replace an existing file.

    Returns:
        The reference model (eval mode) whose weights were written.
    """
    from .conversion.detect import get_variant
    from .conversion.keys import official_checkpoint, to_gamma
    from .families import VARIANTS
    from .files.save import save_pth
    from .parity.inputs import seed_parameters_
    from .parity.references import build_reference

    variant = next((v for v in VARIANTS if model_name in (v.name, v.reference)), None) or get_variant(model_name)
    ref = build_reference(variant)
    seed_parameters_(ref, seed)
    family = variant.family
    save_pth(
        path,
        to_gamma(ref.state_dict(), family),
        overwrite=overwrite,
        wrap=lambda sd: official_checkpoint(sd, family),
    )
    return ref.eval()
