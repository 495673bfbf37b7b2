"""Hub-ready folders: convert, verify and write a folder that timm loads as it is.

:func:`export_folder` converts and verifies a checkpoint and writes a folder that
``timm.create_model("local-dir:DIR", pretrained=True)`` (and, once uploaded,
``"hf-hub:ORG/NAME"``) loads as it is: ``model.safetensors``, timm's ``config.json``,
a ``README.md`` model card (written by :mod:`~timm_layerscale.hub.config` and
:mod:`~timm_layerscale.hub.card`) and, when matplotlib is installed, ``gates.png``. The
same folder loads in transformers (``AutoModelForImageClassification``, ``AutoModel``,
``pipeline("image-classification")``) through its ``TimmWrapper``.

This module sends no request itself: a remote source is fetched through
:func:`~timm_layerscale.files.sources.resolve_source` (by the converter) and ``push_to_hub``
uploads through :func:`~timm_layerscale.hub.upload.push_folder`.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..conversion.detect import model_args
from ..errors import CheckpointError, HubError, LayerScaleError, OutputExistsError
from ..files.atomic import check_output_folder, clear_folder, fills_in_place, hidden_prefix, keep_mode, temporary_folder
from ..files.hub_errors import one_line
from ..files.sources import FOLDER_WEIGHTS, WEIGHTS_NAME, published_path
from .card import CARD_NAME, CONFIG_NAME, PLOT_NAME, build_model_card
from .config import pretrained_tags, read_folder_config, read_label_names, write_config
from .upload import PushResult, check_repo_id, push_folder

__all__ = ["export_folder", "ExportResult"]


def _count_params(weights: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
            total += math.prod(f.get_slice(name).get_shape())
    return total


@dataclass
class ExportResult:
    """What :func:`export_folder` wrote.

    Attributes:
        folder: The export folder.
        files: Files in it, sorted.
        conversion: The :class:`~timm_layerscale.converter.ConversionResult`.
        repo_id: Hub id written into the card's usage code.
        num_params: Parameters in the weights.
        plot: The gate plot, or ``None``.
        plot_note: Why there is no plot, when there is none.
        push: The upload, with ``push_to_hub``.
        gates: The :func:`~timm_layerscale.inspection.gate_profile` rows.
        architecture: The architecture ``config.json`` names (``cait_s24_224_ls``, or
            timm's ``cait_s24_224`` with ``to="gamma"``).
        push_command: The ``timm-layerscale push`` command that uploads the folder as the export
            was asked to (its repository, ``--private``, ``--commit-message``).
    """

    folder: Path
    files: list[Path]
    conversion: Any
    repo_id: str
    num_params: int
    plot: Path | None = None
    plot_note: str | None = None
    push: PushResult | None = None
    gates: list[dict[str, Any]] = field(default_factory=list)
    architecture: str = ""
    push_command: str = ""

    def summary(self) -> str:
        """Human-readable account for the command line."""
        c = self.conversion
        lines = [f"exported {c.source} as {c.variant.name} to {self.folder} in {c.seconds:.1f} s"]
        lines += [f"  {p.name}" for p in self.files]
        if self.plot_note:
            lines.append(f"note: {self.plot_note}")
        if c.report is not None:
            lines.append(c.report.format_table())
        if self.push is not None:
            lines.append(self.push.summary())
        else:
            lines.append(f"upload with: {self.push_command}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        c = self.conversion
        return {
            "folder": str(self.folder),
            "files": [p.name for p in self.files],
            "model": c.variant.name,
            "architecture": self.architecture,
            "repo_id": self.repo_id,
            "num_params": self.num_params,
            "source": c.source,
            "source_sha256": c.source_sha256,
            "seconds": round(c.seconds, 3),
            "report": c.report.to_dict() if c.report is not None else None,
            "plot": self.plot.name if self.plot else None,
            "push": self.push.to_dict() if self.push else None,
        }


def _check_reload(folder: Path, weights: Path) -> None:
    """Load the folder as timm does and check that every weight matches the file."""
    import timm
    import torch
    from safetensors import safe_open

    try:
        model = timm.create_model(f"local-dir:{folder}", pretrained=True)
    except Exception as e:
        raise LayerScaleError(
            f"timm cannot load the exported folder ({one_line(e, 120)}); this is a bug, please report it"
        ) from e
    state = model.state_dict()
    with safe_open(str(weights), framework="pt") as f:
        names = set(f.keys())
        if names != set(state):
            raise LayerScaleError(
                "the exported folder loads with other keys than it holds; this is a bug, please report it"
            )
        for name in names:
            if not torch.equal(state[name], f.get_tensor(name)):
                raise LayerScaleError(
                    f"reloaded weight {name!r} differs from the file; this is a bug, please report it"
                )


def _architecture(variant: Any, to: str) -> str:
    """The architecture an export names: the package's model, or timm's own with ``to="gamma"``."""
    if to == "ls":
        return str(variant.name)
    if variant.family == "deit3":
        raise CheckpointError(
            f"a DeiT-III folder already uses timm's own {variant.name} architecture and layout; leave out to='gamma'"
        )
    if variant.reference is None:
        raise CheckpointError(
            f"timm has no architecture for {variant.name} to load the gamma layout; leave out to='gamma'"
        )
    return str(variant.reference)


def _placeholder_repo_id(folder_name: str) -> str:
    """``ORG/<folder name>`` for the card's usage code, or ``ORG/NAME`` where that is no Hub id."""
    try:
        check_repo_id(f"ORG/{folder_name}")
    except HubError:
        return "ORG/NAME"
    return f"ORG/{folder_name}"


def _deletes_source(source: Path, out: Path) -> bool:
    """Whether replacing the folder ``out`` deletes the local ``source``: a file inside it other
    than the weights the export writes again (re-exporting a folder onto itself is allowed)."""
    if not (source.exists() and out.is_dir()):
        return False
    source, folder = source.resolve(), out.resolve()
    rewritten = source == folder or (source.parent == folder and source.name in FOLDER_WEIGHTS)
    return source.is_relative_to(folder) and not rewritten


def _make_temporary(out: Path) -> tuple[Path, list[Path]]:
    """Create the missing parents of the export folder ``out``, then the temporary folder next to it
    (inside it where it is a mount point or its parent is not writable: :func:`~timm_layerscale.files.atomic.fills_in_place`).

    Returns:
        The temporary folder, and the parent folders created, deepest first (removed again
        if the export fails).
    """
    created = []
    parent = out.absolute().parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create {out.parent} ({e.strerror or e}); choose another folder") from None
        return temporary_folder(out / out.name if fills_in_place(out) else out), created
    except BaseException:
        _remove_empty(created)
        raise


def _remove_empty(folders: Sequence[Path]) -> None:
    """Remove folders this export created, deepest first, while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _swap_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished folder ``tmp`` onto ``out``. Without ``overwrite`` it only takes the place
    of a missing or empty folder (the rename fails on one holding files, which another writer may
    have made since the export began), so of two exports racing to one folder, one wins. Where
    ``tmp`` lies inside ``out`` (:func:`~timm_layerscale.files.atomic.fills_in_place`), its files are moved
    into ``out`` instead, after ``overwrite`` removed what else ``out`` held. A replaced ``out``'s
    permissions are kept."""
    taken = OutputExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")
    if tmp.parent == out:
        if not overwrite and any(p != tmp for p in out.iterdir()):
            raise taken
        clear_folder(out, keep=tmp)
        for p in tmp.iterdir():
            os.replace(p, out / p.name)
        tmp.rmdir()
        return
    keep_mode(tmp, out)
    old = None
    if overwrite and out.exists():
        old = out.parent / f"{hidden_prefix(out)}.old-{secrets.token_hex(4)}"
        os.replace(out, old)
    elif not overwrite:
        with contextlib.suppress(OSError):  # an empty folder (a rename cannot replace one on Windows)
            out.rmdir()
    try:
        os.rename(tmp, out)
    except BaseException as e:
        if old is not None:
            os.replace(old, out)
        if isinstance(e, OSError) and e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise taken from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_folder(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model: str | None = None,
    overwrite: bool = False,
    push_to_hub: str | None = None,
    ema: bool = False,
    options: Any = None,
    private: bool = False,
    commit_message: str | None = None,
    repo_id: str | None = None,
    plot: bool = True,
    command: str | None = None,
    to: str = "ls",
    label_names: Sequence[str] | str | os.PathLike[str] | None = None,
    tag: str | None = None,
) -> ExportResult:
    """Convert, verify and write a folder that timm loads as it is, and optionally upload it.

    The folder holds ``model.safetensors`` (LayerScale-module layout, safetensors
    metadata ``format=pt`` plus the converter's provenance fields), ``config.json``
    (timm's format, written by timm's ``save_config_for_hf``, ``model_args`` only where
    the architecture's defaults differ, so transformers loads it too), ``README.md`` (the
    model card) and, when matplotlib is installed, ``gates.png``. It is built in a
    temporary folder next to ``out_dir``, loaded back with
    ``timm.create_model("local-dir:...", pretrained=True)`` and compared weight for
    weight, and only then moved into place: a failed export leaves nothing behind,
    not even the parent folders it created.

    Args:
        source: Checkpoint file, ``https://`` URL or ``hf-hub:ORG/REPO[/FILE]``.
        out_dir: The folder to write (parents are created).
        model: Model name overriding architecture detection.
        overwrite: Replace ``out_dir`` if it exists and is not empty.
        push_to_hub: Upload the folder to this ``ORG/NAME`` after writing it.
        ema: Take the ``'model_ema'`` weights of a training checkpoint.
        options: Verification options (:class:`~timm_layerscale.parity.tolerance.VerifyOptions`).
        private: With ``push_to_hub``, create the repository as private.
        commit_message: With ``push_to_hub``, the commit message.
        repo_id: Hub id for the card's usage code (default ``push_to_hub``, else
            ``ORG/<folder name>``, or ``ORG/NAME`` where the folder name is no Hub name).
        plot: Draw ``gates.png`` when matplotlib is installed.
        command: Command line recorded in the card (default: the equivalent
            ``timm-layerscale export`` command, local paths by their names).
        to: ``"ls"`` (this package's architecture, ``ls1.gamma``) or, for CaiT,
            ``"gamma"``: timm's own ``cait_*`` architecture and layout, which timm and
            transformers load without this package. DeiT-III folders always use timm's
            own ``deit3_*``; ViT-5 has no timm architecture.
        label_names: Class names for a fine-tuned head: a list, or a file with one name
            per line (``name<TAB>description`` allowed), a JSON list or a JSON object from
            class index to name (transformers' ``id2label``). Without them, the names
            in the ``config.json`` of a source folder (an exported one, one saved by
            transformers' ``save_pretrained``) or ``hf-hub:`` repository; else a
            1000-class model keeps timm's ImageNet labels and other sizes get none.
        tag: Pretrained tag written into ``config.json`` (default: the source folder's or
            repository's, where the architecture has it, else the architecture's default
            tag, e.g. ``fb_dist_in1k``).

    Returns:
        An :class:`ExportResult`; ``summary()`` prints it.

    Raises:
        OutputExistsError: ``out_dir`` is not empty and ``overwrite`` is false.
        CheckpointError: ``out_dir`` holds the source file (other than its own weights) or
            the current folder, the source holds NaN or Inf, the label names do not fit the
            classifier, the tag is unknown, or ``to`` does not apply to the family; each
            before converting.
        ParityError: The converted model does not match the reference.
        HubError: ``push_to_hub`` or ``repo_id`` is no Hub id (before converting), or download
            or upload failed (the folder is kept when only the upload failed).
        LayerScaleError: Any other problem with the source or the folder.
    """
    from ..converter import convert_checkpoint, load_source
    from ..files.read import check_finite
    from ..inspection import MissingPlotDependency, gate_profile, plot_gates
    from ..options import command_line, published_options

    out = Path(out_dir)
    for hub_id in (push_to_hub, repo_id):
        if hub_id:
            check_repo_id(hub_id)
    if _deletes_source(Path(source), out):
        raise CheckpointError(f"{out} holds the source {source}; replacing it would delete it, choose another folder")
    out = check_output_folder(out, overwrite)
    label_file = None
    folder_names, descriptions, folder_tag = (None, None, None) if label_names and tag else read_folder_config(source)
    names: Sequence[str] | None = folder_names
    if isinstance(label_names, (str, os.PathLike)):
        label_file = label_names
        names, descriptions = read_label_names(label_file)
    elif label_names is not None:
        names, descriptions = label_names, None
    repo = repo_id or push_to_hub or _placeholder_repo_id(out.name)
    tmp, created = _make_temporary(out)
    try:
        weights = tmp / WEIGHTS_NAME
        # The config needs only the variant: its refusals (no gamma architecture, an unknown
        # tag, a wrong label count) come before converting, as does that of NaN or Inf, which
        # no published model holds (convert's allow_nonfinite does not apply). The state dict
        # is not kept, so a source that cannot be mapped is not held in memory twice.
        path, sd, variant, info = load_source(source, model=model, ema=ema)
        check_finite(sd, path, advice="a published model must be finite, check the source checkpoint")
        del sd
        architecture = _architecture(variant, to)
        tags = pretrained_tags(architecture)
        written_tag = tag or (folder_tag if folder_tag in tags else None)
        try:
            config = write_config(
                f"{architecture}.{written_tag}" if written_tag else architecture,
                tmp / CONFIG_NAME,
                model_args=model_args(info),
                label_names=names,
                label_descriptions=descriptions,
            )
        except CheckpointError as e:
            if folder_names is None or names is not folder_names or (tag and tag not in tags):
                raise  # not about names from the source's config.json
            raise CheckpointError(f"{Path(source) / CONFIG_NAME}: {e}, or pass label_names='FILE'") from None
        conv = convert_checkpoint(source, weights, model=model, to=to, fmt="safetensors", ema=ema, options=options)
        _check_reload(tmp, weights)
        gates = gate_profile(weights)
        plot_path, plot_note = None, None
        if plot:
            try:
                plot_path = plot_gates(
                    gates, tmp / PLOT_NAME, title=f"{conv.variant.name}: LayerScale gates across depth"
                )
            except MissingPlotDependency as e:
                plot_note = f"no {PLOT_NAME}: {e}"
        num_params = _count_params(weights)
        cmd = command or command_line(
            ("timm-layerscale", "export", published_path(source), published_path(out_dir)),
            published_options(options),
            model=model,
            ema=ema,
            push_to_hub=push_to_hub,
            private=bool(push_to_hub and private),
            to=None if to == "ls" else to,
            label_names=label_file and published_path(label_file),
            tag=tag,
        )
        card = build_model_card(
            conv,
            repo_id=repo,
            config=config,
            num_params=num_params,
            command=cmd,
            gates=gates,
            plot=PLOT_NAME if plot_path else None,
        )
        card.save(tmp / CARD_NAME)
        _swap_into_place(tmp, out, overwrite)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        if isinstance(e, OSError):
            raise CheckpointError(
                f"writing {out} failed ({e.strerror or e}); nothing was written, free space or choose another folder"
            ) from None
        if isinstance(e, CheckpointError) and str(tmp) in str(e):  # name the folder, not its temporary
            raise CheckpointError(str(e).replace(str(tmp), str(out))) from None
        raise
    conv.output = out / WEIGHTS_NAME
    result = ExportResult(
        folder=out,
        files=sorted(p for p in out.iterdir() if p.is_file()),
        conversion=conv,
        repo_id=repo,
        num_params=num_params,
        plot=out / PLOT_NAME if plot_path else None,
        plot_note=plot_note,
        gates=gates,
        architecture=architecture,
        push_command=command_line(
            ("timm-layerscale", "push", out, push_to_hub or repo), private=private, commit_message=commit_message
        ),
    )
    if push_to_hub:
        try:
            result.push = push_folder(out, push_to_hub, private=private, commit_message=commit_message)
        except HubError as e:
            raise HubError(f"{e} (the folder {out} was written; upload it later with: {result.push_command})") from e
    return result
