"""An exported folder's ``config.json`` (timm's, read by ``timm.create_model("local-dir:DIR")`` and by
transformers' ``TimmWrapper``; or for a transformers layout, transformers' own) and the class names it may carry."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from ..conversion.detect import timm_args
from ..errors import CheckpointError, option
from ..families import DEFAULT_NUM_CLASSES, Layout
from ..files.read import CONFIG_NAME, Source

__all__ = ["pretrained_tags", "read_folder_config", "read_label_names", "write_config", "write_folder_config"]


def _timm_config(model: Any, model_config: Mapping[str, Any]) -> dict[str, Any]:
    """What ``timm.models.save_config_for_hf`` writes for ``model``, as a dict."""
    from timm.models._hub import save_config_for_hf

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        save_config_for_hf(model, path, model_config=dict(model_config))  # type: ignore[arg-type]  # timm before 1.0.31 calls path.open()
        return json.loads(path.read_text(encoding="utf-8"))


def write_config(
    model_name: str,
    path: str | os.PathLike[str],
    *,
    model_args: Mapping[str, Any] | None = None,
    label_names: Sequence[str] | None = None,
    label_descriptions: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Write and return timm's ``config.json`` for ``model_name`` (``cait_s24_224_ls``, or with a pretrained tag
    timm registers: ``deit3_small_patch16_224.fb_in22k_ft_in1k``), by ``timm.models.save_config_for_hf`` on a
    meta-device model built with ``model_args`` (``num_classes``, ``img_size``).

    Its ``model_args`` keeps only values that differ from the architecture's default and never ``num_classes``
    (transformers passes ``num_classes=num_labels`` beside them, and a repeat fails); ``img_size`` always
    stays. ``label_names`` (one per class) and ``label_descriptions`` (by name) are timm's fields.

    Raises:
        CheckpointError: ``label_names`` are not unique, non-empty strings, one per class, or the tag is unknown.
    """
    import timm
    import torch

    arch, _, tag = model_name.partition(".")
    tags = pretrained_tags(arch)
    if tag and tag not in tags:
        raise CheckpointError(f"{tag!r} is not a pretrained tag of {arch}; choose from: {', '.join(tags) or 'none'}")
    with torch.device("meta"):
        kwargs = timm_args(model_args or {})
        model = timm.create_model(model_name, **kwargs)
        default = timm.create_model(model_name) if kwargs else model
    extra: dict[str, Any] = {}
    if label_names is not None:
        _check_names(label_names, "label_names")
        if len(label_names) != model.num_classes:
            raise CheckpointError(
                f"{len(label_names)} label names for a model with {model.num_classes} classes; give one name per class"
            )
        extra["label_names"] = list(label_names)
    if label_descriptions:
        extra["label_descriptions"] = dict(label_descriptions)
    config = _timm_config(model, extra)
    defaults = _timm_config(default, {}).get("model_args", {})
    args = {k: v for k, v in config.pop("model_args", {}).items() if k != "num_classes" and defaults.get(k) != v}
    if model_args and "img_size" in model_args:  # timm before 1.0.31 does not record it
        args["img_size"] = model_args["img_size"]
    if args:
        config["model_args"] = args
    Path(path).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return config


def pretrained_tags(arch: str) -> list[str]:
    """The pretrained tags timm registers for the architecture ``arch``."""
    import timm

    return [n.partition(".")[2] for n in timm.list_pretrained(f"{arch}.*")]


def read_folder_config(fields: Mapping[str, Any] | None) -> tuple[Any, dict[str, str] | None, Any]:
    """The class names, their descriptions and the pretrained tag in the fields of the ``config.json`` beside a
    source's weights (a folder written by this package, timm or transformers, or a Hub repository); ``None`` for
    what is missing, and for the names transformers gives a head it has no names for (``LABEL_0``, ...)."""
    fields = fields or {}
    tag = cfg.get("tag") if isinstance(cfg := fields.get("pretrained_cfg"), dict) else None
    names = fields.get("label_names")
    if not names or names == [f"LABEL_{i}" for i in range(len(names))]:
        return None, None, tag
    descriptions = fields.get("label_descriptions")
    return names, descriptions if isinstance(descriptions, dict) else None, tag


def read_label_names(path: str | os.PathLike[str]) -> tuple[list[str], dict[str, str] | None]:
    """The class names in class order and their descriptions by name (or ``None``) from a JSON list of strings,
    a JSON object from class index to name (transformers' ``id2label``), or one ``name[<TAB>description]`` per
    line. A :class:`~timm_layerscale.errors.CheckpointError` if the file cannot be read, or its names are
    empty, not strings or repeated."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark, as Windows editors write, is not a name
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise CheckpointError(
            f"cannot read the label file {p} ({reason}); pass a UTF-8 text file, one name per line"
        ) from None
    descriptions: dict[str, str] | None = None
    if text.lstrip().startswith(("[", "{")):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f"{p} is not valid JSON ({e.msg} at line {e.lineno}); fix it or write one name per line"
            ) from None
        if isinstance(names, dict):
            indices = [str(i) for i in range(len(names))]
            names = [names[i] for i in indices] if sorted(names) == sorted(indices) else None
        if not isinstance(names, list):
            raise CheckpointError(
                f"{p} is neither a list of names nor an object from every class index to a name;"
                ' write ["tench", ...] or {"0": "tench", ...}'
            )
    else:
        names, descriptions = [], {}
        for line in text.rstrip("\r\n").splitlines():
            name, _, description = line.partition("\t")
            names.append(name.strip())
            if description.strip():
                descriptions[name.strip()] = description.strip()
    _check_names(names, str(p))
    return names, descriptions or None


def _check_names(names: Sequence[Any], where: str) -> None:
    """Class names are strings, one per class, none empty and none twice."""
    if wrong := [n for n in names if not isinstance(n, str)]:
        raise CheckpointError(f"{where} holds {wrong[0]!r}, not a name; give one string per class")
    empty = [i for i, n in enumerate(names) if not n]
    if empty or not names:
        what = f"no name for class {empty[0]}" if empty else "no class names"
        raise CheckpointError(f"{where} holds {what}; write one name per class")
    if repeated := sorted(n for n, count in Counter(names).items() if count > 1):
        raise CheckpointError(f"{where} names a class twice ({repeated[0]!r}); class names must be unique")


def _library_config(src: Source, layout: Layout, folder: Path) -> dict[str, Any]:
    """Write transformers' ``config.json`` of the source's variant (its ``layout``'s config class, from the shapes of
    its tensors in the ``ls`` layout, naming the model class ``AutoModel`` builds) into ``folder``; return what the
    card reads of it: that class as ``architecture``, no classifier, the variant's pretrained config (its licence
    and paper) without a tag.

    Raises:
        CheckpointError: A checkpoint with a classifier (transformers' backbone has none).
    """
    import timm
    from transformers import MODEL_MAPPING

    variant, overrides = src.detection.variant, src.detection.overrides
    if overrides.get("num_classes", DEFAULT_NUM_CLASSES):
        raise CheckpointError(
            f"transformers' {variant.family.title} model has no classifier to hold this checkpoint's "
            f"head; export the backbone, or leave out {option('to', 'transformers')}"
        )
    assert layout.config is not None
    config = layout.config(variant, {k: tuple(t.shape) for k, t in src.detection.state_dict.items()})
    if "img_size" in overrides:
        config.image_size = overrides["img_size"]
    architecture = cast(type, MODEL_MAPPING[type(config)]).__name__
    config.architectures = [architecture]
    config.save_pretrained(folder)
    pcfg = {k: v for k, v in cast(Any, timm.models.get_pretrained_cfg(variant.name)).to_dict().items() if k != "tag"}
    return {"architecture": architecture, "num_classes": 0, "library": "transformers", "pretrained_cfg": pcfg}


def write_folder_config(
    src: Source,
    layout: Layout,
    folder: Path,
    tag: str | None = None,
    labels: tuple[Sequence[str], dict[str, str] | None] | None = None,
) -> dict[str, Any]:
    """Write an exported folder's ``config.json`` into ``folder`` and return what the card reads of it: transformers'
    for a library's ``layout``, else timm's (:func:`write_config`) of the architecture exported (the variant's own for
    the ``ls`` layout, timm's twin otherwise) under ``tag`` or the tag of the source's ``config.json`` where the
    architecture has it, with ``labels`` (class names and their descriptions) or the source's.

    Raises:
        CheckpointError: As :func:`write_config`; an error about the names the source's ``config.json`` holds says
            to pass others.
    """
    if layout.library:
        return _library_config(src, layout, folder)
    names, descriptions, folder_tag = read_folder_config(src.config_json)
    if labels:
        names, descriptions = labels
    variant = src.detection.variant
    architecture = variant.name if layout is variant.family.layouts["ls"] else str(variant.reference)
    tags = pretrained_tags(architecture)
    written_tag = tag or (folder_tag if folder_tag in tags else None)
    try:
        return write_config(
            f"{architecture}.{written_tag}" if written_tag else architecture,
            folder / CONFIG_NAME,
            model_args=src.detection.overrides,
            label_names=names,
            label_descriptions=descriptions,
        )
    except CheckpointError as e:
        if labels or names is None or (tag and tag not in tags):
            raise  # not about the names of the source's config.json
        raise CheckpointError(f"{src.config_file}: {e}, or pass {option('label_names', 'FILE')}") from None
