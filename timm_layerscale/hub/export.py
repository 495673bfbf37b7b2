"""Hub-ready folders: ``model.safetensors``, timm's ``config.json``, a ``README.md`` card and ``gates.png``,
which ``timm.create_model("local-dir:DIR", pretrained=True)`` (``"hf-hub:ORG/NAME"`` once uploaded)
and transformers' ``TimmWrapper`` load as they are; or, for a transformers layout, transformers' own folder."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ..errors import CheckpointError, HubError, LayerScaleError, one_line
from ..families import ALIAS
from ..families.loaders import without_progress_bars
from ..files.atomic import folder_output
from ..files.read import FOLDER_WEIGHTS, WEIGHTS_NAME, check_finite, published_path
from .card import CARD_NAME, PLOT_NAME, build_model_card
from .config import read_label_names, write_folder_config
from .upload import PushResult, check_repo_id, push_folder

__all__ = ["ExportResult", "export_folder"]


@dataclass
class ExportResult:
    """What :func:`export_folder` wrote: the folder and its files, the
    :class:`~timm_layerscale.converter.ConversionResult`, the Hub id in the card's usage code, the parameter
    count, the architecture ``config.json`` names, the ``push`` command that uploads the folder as asked, the
    gate plot (or ``None``, ``plot_note`` saying why), the upload (with ``push_to_hub``), the gate rows and the line
    saying which layout ``gamma`` named."""

    folder: Path
    files: list[Path]
    conversion: Any
    repo_id: str
    num_params: int
    architecture: str
    push_command: str
    plot: Path | None = None
    plot_note: str | None = None
    push: PushResult | None = None
    gates: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""

    def summary(self) -> str:
        """What was written, for the command line."""
        c = self.conversion
        lines = [f"exported {c.source} as {c.variant.name} to {self.folder} in {c.seconds:.1f} s"]
        lines += [f"  {p.name}" for p in self.files]
        lines += [f"note: {n}" for n in (self.note, self.plot_note) if n]
        lines += [c.report.format_table()] if c.report is not None else []
        lines.append(self.push.summary() if self.push is not None else f"upload with: {self.push_command}")
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


def _check_reload(folder: Path, written: Mapping[str, Any]) -> None:
    """Load the folder as timm does and check that every weight is the one written."""
    import timm
    import torch

    try:
        state = timm.create_model(f"local-dir:{folder}", pretrained=True).state_dict()
    except Exception as e:
        raise LayerScaleError(
            f"timm cannot load the exported folder ({one_line(e, 120)}); this is a bug, please report it"
        ) from e
    if state.keys() != written.keys() or not all(torch.equal(state[k], v) for k, v in written.items()):
        raise LayerScaleError("the exported folder loads other weights than it holds; this is a bug, please report it")


def _check_library_reload(folder: Path, written: Mapping[str, Any]) -> None:
    """Load the folder with transformers' ``AutoModel`` and check that it takes every tensor, and only those, as
    written (by value: transformers 5 renames some keys as it loads)."""
    import hashlib

    import torch
    from transformers import AutoModel

    def held(tensors: Any) -> list[tuple[Any, ...]]:
        views = (t.detach().contiguous() for t in tensors)
        return sorted(
            (tuple(t.shape), str(t.dtype), hashlib.sha256(t.view(-1).view(torch.uint8).numpy()).hexdigest())
            for t in views
        )

    try:
        with without_progress_bars():
            model, info = AutoModel.from_pretrained(folder, output_loading_info=True)
    except Exception as e:
        raise LayerScaleError(
            f"transformers cannot load the exported folder ({one_line(e, 120)}); this is a bug, please report it"
        ) from e
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise LayerScaleError(f"transformers loads the exported folder with {info}; this is a bug, please report it")
    if held(model.state_dict().values()) != held(written.values()):
        raise LayerScaleError("the exported folder loads other weights than it holds; this is a bug, please report it")


def _placeholder_repo_id(name: str) -> str:
    """``ORG/<folder name>`` for the card's usage code, or ``ORG/NAME`` where that is no Hub id."""
    try:
        return check_repo_id(f"ORG/{name}")
    except HubError:
        return "ORG/NAME"


def _check_folder(source: str | os.PathLike[str], folder: Path, push_to_hub: str | None, repo_id: str | None) -> None:
    """One-line errors for Hub ids that are none, and for an output ``folder`` (resolved) that holds the source (a
    folder exported onto itself is replaced whole)."""
    for hub_id in (push_to_hub, repo_id):
        if hub_id:
            check_repo_id(hub_id)
    given = Path(source).resolve()
    rewritten = given == folder or (given.parent == folder and given.name in FOLDER_WEIGHTS)
    if given.exists() and folder.is_dir() and given.is_relative_to(folder) and not rewritten:
        raise CheckpointError(
            f"{folder} holds the source {source}; replacing it would delete it, choose another folder"
        )


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
    """Convert and verify a checkpoint into a folder that timm and transformers load, and optionally upload it.

    The files are built in a hidden folder beside ``out_dir``, loaded back with
    ``timm.create_model("local-dir:...", pretrained=True)`` and compared weight for weight, and only then
    swapped in for ``out_dir`` with renames: a failed or interrupted export leaves what was there.

    Args:
        source, model, ema, options: As for :func:`~timm_layerscale.converter.convert_checkpoint`.
        overwrite: Write into a folder that is not empty, removing its other files.
        push_to_hub, private, commit_message: Upload the folder to this ``ORG/NAME`` once written.
        repo_id: Hub id for the card's usage code (default ``push_to_hub``, else ``ORG/<folder name>``).
        plot: Draw ``gates.png`` when matplotlib is installed.
        command: Command line recorded in the card (default the equivalent ``timm-layerscale export``).
        to: ``"ls"`` (this package's architecture); ``"timm"``: timm's own architecture (``"gamma"``, a word of one
            release, means it); for DINOv2 and DINOv3 ``"transformers"``: transformers' own folder, which
            ``AutoModel`` loads.
        label_names: Class names of a fine-tuned head, a list or a file
            (:func:`~timm_layerscale.hub.config.read_label_names`). Default: those of the source's
            ``config.json``, else timm's ImageNet labels for 1000 classes.
        tag: Pretrained tag written into ``config.json`` (default the source's, else the architecture's).

    Raises:
        OutputExistsError: ``out_dir`` is not empty and ``overwrite`` is false.
        CheckpointError: ``out_dir`` holds the source or the current folder, the source holds NaN or Inf, the
            labels do not fit the classifier, the tag is unknown, or ``to`` does not apply; before converting.
        ParityError: The converted model does not match the reference.
        HubError: A bad Hub id (before converting), or the download or upload failed (the folder is kept).
    """
    from ..converter import check_request, convert_checkpoint
    from ..files.read import read_source
    from ..inspection import MissingPlotDependency, gate_rows, gate_summary, plot_gates
    from ..options import command_line, published_options

    check_request(to, folder=True)
    out = Path(out_dir).resolve()  # the folder itself, through links and ``..``
    _check_folder(source, out, push_to_hub, repo_id)
    label_file = label_names if isinstance(label_names, (str, os.PathLike)) else None
    labels = (
        read_label_names(label_file) if label_file else (list(cast(Any, label_names)), None) if label_names else None
    )
    repo = repo_id or push_to_hub or _placeholder_repo_id(out.name)
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
    with folder_output(Path(out_dir), overwrite) as tmp:
        src = read_source(source, model=model, ema=ema)
        src.check()  # damage inside the file can read as NaN: say that first
        check_finite(src.state_dict, src.path, "a published model must be finite, check the source checkpoint")
        src.finite = True
        layout = src.detection.variant.family.layout("timm" if to == ALIAS else to, written=True)
        config = write_folder_config(src, layout, tmp, tag, labels)
        conv = convert_checkpoint(src, tmp / WEIGHTS_NAME, to=layout.name, fmt="safetensors", options=options)
        (_check_library_reload if layout.library else _check_reload)(tmp, conv.state_dict)
        gates = gate_rows(src.detection.state_dict if layout.library else conv.state_dict, family=conv.variant.family)
        num_params = sum(t.numel() for t in conv.state_dict.values())
        summary = gate_summary(gates)
        plot_note = None
        try:
            if plot:
                plot_gates(gates, tmp / PLOT_NAME, title=f"{conv.variant.name}: LayerScale gates")
        except MissingPlotDependency as e:
            plot_note = f"no {PLOT_NAME}: {e}"
        card = build_model_card(
            conv,
            repo_id=repo,
            config=config,
            num_params=num_params,
            command=cmd,
            gate_summary=summary,
            plot=PLOT_NAME if plot and not plot_note else None,
        )
        card.save(tmp / CARD_NAME)
    conv.output, conv.state_dict = out / WEIGHTS_NAME, {}
    note = f"{ALIAS!r} is a word of one release: wrote timm's own {config['architecture']}; pass --to timm"
    result = ExportResult(
        folder=out,
        files=sorted(p for p in out.iterdir() if p.is_file()),
        conversion=conv,
        repo_id=repo,
        num_params=num_params,
        architecture=config["architecture"],
        push_command=command_line(
            ("timm-layerscale", "push", out, push_to_hub or repo), private=private, commit_message=commit_message
        ),
        plot_note=plot_note,
        gates=gates,
        plot=out / PLOT_NAME if plot and not plot_note else None,
        note=note if to == ALIAS else "",
    )
    if push_to_hub:
        try:
            result.push = push_folder(out, push_to_hub, private=private, commit_message=commit_message)
        except HubError as e:
            raise HubError(f"{e} (the folder {out} was written; upload it later with: {result.push_command})") from e
    return result
