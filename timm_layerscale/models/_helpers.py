"""What the two model files share, as plain functions of a model: its timm methods' common parts, the
filter's last steps, a registered variant's config and build, the operation count."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, cast

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import resample_abs_pos_embed
from timm.models import build_model_with_cfg
from timm.models._features import feature_take_indices
from timm.models._manipulate import checkpoint

from ..conversion.fold import fold_state_dict
from ..families import DEFAULT_NUM_CLASSES, Gate, Variant
from ..layer_scale import LayerScale, fold_block, fold_plan

__all__ = ["add_pos_embed", "build_variant", "check_global_pool", "count_flops", "fit_state_dict", "pretrained_cfg"]
__all__ += ["GatedBlock", "LayerScaleModel", "register_variants", "twin_cfgs"]


def check_global_pool(global_pool: str) -> None:
    if global_pool not in ("", "token", "avg"):
        raise ValueError(f"global_pool must be 'token', 'avg' or '', got {global_pool!r}")


def add_pos_embed(x: torch.Tensor, pos_embed: torch.Tensor, grid: tuple[int, int], dynamic: bool) -> torch.Tensor:
    """Patch tokens ``(B, N, C)`` (``(B, h, w, C)`` when ``dynamic``) plus the position embedding of the
    ``grid``, resampled to the input's grid when ``dynamic``: ``(B, N, C)``. The model files make it one node
    of an FX trace (``torch.fx.wrap``), since the resampling branches on the input's size."""
    if not dynamic:
        return x + pos_embed
    B, H, W, C = x.shape
    return x.view(B, -1, C) + resample_abs_pos_embed(pos_embed, new_size=(H, W), old_size=grid, num_prefix_tokens=0)


def has_no_layerscale(model: nn.Module) -> bool:
    """A model's ``folded_layerscale``: it has no LayerScale modules, its gates (if any) folded into its linears."""
    return not any(isinstance(m, LayerScale) for m in model.modules())


class GatedBlock:
    """What a timm block whose raw gates became LayerScale modules adds to its class (a mixin placed before it):
    ``GATES`` are its family's gates, each timm's raw parameter (``gamma_1``) made the module it names (``ls1``)."""

    GATES: ClassVar[tuple[Gate, ...]]

    def reset_parameters(self) -> None:
        """Each gate to its initial value (timm's block resets its raw gammas)."""
        for name in (gate.name for gate in self.GATES):
            if isinstance(gate := getattr(self, name), LayerScale):
                gate.reset_parameters()

    def reparameterize(self) -> None:
        """Fold each gate into the layer before it, as ``timm.utils.reparameterize_model`` asks."""
        fold_block(cast(nn.Module, self), fold_plan(cast(nn.Module, self), self.GATES))

    @classmethod
    def from_block(cls, block: Any, init_value: Any, folded: bool = False) -> Any:
        """``block`` itself, its class changed and each raw gate moved into a LayerScale module (the same parameter
        object, so values, device and dtype stay; ``promote=True``, as timm's raw product promotes under autocast), or
        ``nn.Identity`` where the block has none or ``folded``."""
        block.__class__ = cls
        for record in cls.GATES:
            gamma = block._parameters.pop(record.raw["timm"], None)
            gate: nn.Module = nn.Identity()
            if gamma is not None and not folded:
                gate = LayerScale(gamma.shape[0], init_value, promote=True, device="meta")
                gate.gamma = gamma
            setattr(block, record.name, gate)
        return block


class LayerScaleModel:
    """What a timm model whose blocks were turned into LayerScale-module blocks adds to its class (a mixin placed
    before it): ``folded_layerscale`` and ``flop_count``."""

    __jit_unused_properties__: ClassVar[list[str]] = ["folded_layerscale"]  # not compiled by TorchScript

    @property
    def folded_layerscale(self) -> bool:
        """The model has no LayerScale modules (built folded, or folded since)."""
        return has_no_layerscale(cast(nn.Module, self))

    @torch.jit.ignore
    def flop_count(self, batch_size: int = 1) -> int:
        """Multiplications of one forward pass at the model's input size (:func:`count_flops`)."""
        return count_flops(self, batch_size)


def run_blocks(
    model: Any, x: torch.Tensor, indices: int | list[int] | None, norm: bool, stop_early: bool, *args: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``forward_intermediates``' pass: the blocks on ``x`` (and ``args``), the last stopping early where asked,
    and the outputs of those ``indices`` selects (the last ``n`` for an int; through the final norm with ``norm``)."""
    take, last = feature_take_indices(len(model.blocks), indices)
    kept = []
    for i, blk in enumerate(model.blocks[: last + 1] if stop_early else model.blocks):
        x = checkpoint(blk, x, *args) if model.grad_checkpointing else blk(x, *args)
        if i in take:
            kept.append(model.norm(x) if norm else x)
    return x, kept


def prune_blocks(model: Any, indices: int | list[int], prune_norm: bool) -> list[int]:
    """Drop the blocks after the last of ``indices`` (and the final norm, with ``prune_norm``); the indices kept."""
    take, last = feature_take_indices(len(model.blocks), indices)
    model.blocks = model.blocks[: last + 1]
    if prune_norm:
        model.norm = nn.Identity()
    return take


def reset_head(model: Any, num_classes: int, global_pool: str | None) -> None:
    """A new head of ``num_classes`` (0: none) on the model's device, dtype and mode; another pooling if given."""
    if global_pool is not None:
        check_global_pool(global_pool)
        if global_pool == "token" and not model.num_prefix_tokens:
            raise ValueError("token pooling needs the class token, which was pruned")
        model.global_pool = global_pool
    model.num_classes = num_classes
    p = next(model.parameters())
    model.head = (
        nn.Linear(model.num_features, num_classes, device=p.device, dtype=p.dtype) if num_classes > 0 else nn.Identity()
    )
    model.head.train(model.training)


def to_nchw(tokens: Iterable[torch.Tensor], grid: tuple[int, int]) -> list[torch.Tensor]:
    """Patch tokens ``(B, h * w, C)`` as feature maps ``(B, C, h, w)``."""
    return [y.reshape(y.shape[0], grid[0], grid[1], y.shape[-1]).permute(0, 3, 1, 2).contiguous() for y in tokens]


def fit_state_dict(state_dict: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """The filter's last steps: ``pos_embed`` resampled to the model's grid where it differs, and the gates
    folded into the linear layers for a model without LayerScale modules (``folded_layerscale``)."""
    pe = state_dict.get("pos_embed")
    if pe is not None and pe.shape != model.pos_embed.shape:
        state_dict["pos_embed"] = resample_abs_pos_embed(
            pe, new_size=model.patch_embed.grid_size, num_prefix_tokens=0, verbose=False
        )
    return fold_state_dict(state_dict) if model.folded_layerscale else state_dict


def pretrained_cfg(v: Variant, **kwargs: Any) -> dict[str, Any]:
    """A variant's pretrained config: an ImageNet-1k classifier at ``v.img_size``, plus ``kwargs``."""
    return {
        "num_classes": DEFAULT_NUM_CLASSES,
        "input_size": (3, v.img_size, v.img_size),
        "pool_size": None,
        "crop_pct": 1.0,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        **kwargs,
    }


def twin_cfgs(variants: Mapping[str, Variant]) -> dict[str, Any]:
    """timm's pretrained configs of each variant's reference (its Hub files, licence, input size) under this package's
    names, for the tags the installed timm has, its default first."""
    from timm.models import get_arch_pretrained_cfgs

    cfgs: dict[str, Any] = {}
    for name, v in variants.items():
        for ref, cfg in get_arch_pretrained_cfgs(str(v.reference)).items():
            drop = ("architecture", "tag")
            cfgs[f"{name}.{ref.split('.', 1)[1]}"] = {k: x for k, x in cfg.to_dict().items() if k not in drop}
    return cfgs


def register_variants(module: str, variants: Mapping[str, Variant], build: Callable[..., Any]) -> None:
    """Register with timm, as functions of ``module`` named like the variants, ``build(variant, pretrained, kwargs)``
    of each variant: what a hand-written ``@register_model`` function per variant does."""
    import sys

    from timm.models import register_model

    for name, v in variants.items():

        def create(pretrained: bool = False, v: Variant = v, **kwargs: Any) -> Any:
            return build(v, pretrained, kwargs)

        create.__name__ = create.__qualname__ = name
        create.__module__ = module
        create.__doc__ = f"``{name}``, {v.family.title} with LayerScale modules (``{module}``)."
        setattr(sys.modules[module], name, register_model(create))


def build_variant(
    cls: type, filter_fn: Callable[..., Any], v: Variant, pretrained: bool, kwargs: dict[str, Any]
) -> Any:
    """timm's ``build_model_with_cfg`` of a registered variant: its table row's arguments, then ``kwargs``."""
    kwargs = {**v.model_args, **kwargs}
    out_indices = kwargs.pop("out_indices", 3)
    feature_cfg = {"out_indices": out_indices, "feature_cls": "getter"}
    return build_model_with_cfg(
        cls, v.name, pretrained, pretrained_filter_fn=filter_fn, feature_cfg=feature_cfg, **kwargs
    )


def count_flops(model: Any, batch_size: int = 1) -> int:
    """Multiplications of one forward pass at the model's input size, run on the meta device: half what
    ``torch.utils.flop_counter.FlopCounterMode`` counts (it counts a multiply-add as two), plus each
    LayerScale's one multiply per element, which it leaves out."""
    from torch.utils.flop_counter import FlopCounterMode

    meta = {k: torch.empty_like(v, device="meta") for k, v in [*model.named_parameters(), *model.named_buffers()]}
    gates = [0]

    def count(module: Any, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        gates[0] += module.flop_count(out.numel() // module.dim)

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, LayerScale)]
    size = model.patch_embed.img_size if hasattr(model, "patch_embed") else model.pretrained_cfg["input_size"][1:]
    x = torch.empty(batch_size, model.in_chans, *size, device="meta")
    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            torch.func.functional_call(model, meta, (x,))
    finally:
        for hook in hooks:
            hook.remove()
    return counter.get_total_flops() // 2 + gates[0]
