"""What the DINO families share: the training checkpoints' heads, the value operations between fused and split
projections, and the loader native to a transformers file (transformers' own model class, its config built from the
variant's shapes), imported only when called; transformers is the optional extra ``timm-layerscale[transformers]``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import RemapError, option

__all__ = ["TRAINING_HEADS", "fuse_qkv", "native_transformers", "split_qkv", "without_training_heads"]
__all__ += ["zeros_like_token"]

#: The self-supervised objective's heads beside the backbone in a training checkpoint (``teacher_checkpoint.pth``).
TRAINING_HEADS = r"(?:dino_head|ibot_head)\..+"


def without_training_heads(filter_fn: Callable[[dict[str, Any], Any], Any]) -> Callable[[dict[str, Any], Any], Any]:
    """``filter_fn`` on a state dict without :data:`TRAINING_HEADS`, which the official evaluation code's loading
    leaves out (it loads the backbone alone)."""
    import re

    return lambda sd, model: filter_fn({k: v for k, v in sd.items() if not re.fullmatch(TRAINING_HEADS, k)}, model)


def fuse_qkv(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Separate q, k and v projection weights ``(C, C)`` each as one fused ``qkv`` weight ``(3C, C)`` at ``target``:
    the q key's operation concatenates the three (a copy); the k and v keys' give nothing.

    Raises:
        RemapError: The q key's k or v partner is missing.
    """
    for q, k, v in (("q_proj", "k_proj", "v_proj"), ("query", "key", "value")):
        if f".{q}." in key:
            parts = [key, key.replace(f".{q}.", f".{k}."), key.replace(f".{q}.", f".{v}.")]
            missing = [p for p in parts if p not in state_dict]
            if missing:
                raise RemapError(f"checkpoint has {key!r} but not {', '.join(missing)}; q, k and v come together")
            import torch

            return {target: torch.cat([state_dict[p] for p in parts])}
    return {}  # the k or v key: taken by the q key's operation


def split_qkv(names: tuple[str, str, str]) -> Callable[[str, Any, str, Mapping[str, Any]], dict[str, Any]]:
    """The inverse of :func:`fuse_qkv`: a fused weight or bias ``(3C, ...)`` as three (views), at ``target`` plus
    each of ``names``."""

    def split_qkv(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        return {target.format(name): part for name, part in zip(names, tensor.chunk(3), strict=True)}

    return split_qkv


def zeros_like_token(shape: Callable[[Any], tuple[int, ...]], name: str) -> Callable[..., dict[str, Any]]:
    """A rule's operation keeping a token and synthesising ``name``, zeros of ``shape(token)`` (a mask token of a
    layout that stores one but never uses it at inference)."""

    def with_mask_token(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        return {target: tensor, name: torch.zeros(shape(tensor), dtype=tensor.dtype)}

    return with_mask_token


def native_transformers(
    config: Callable[[Any, Mapping[str, tuple[int, ...]]], Any], variant: Any, args: dict[str, Any], any_size: bool
) -> Any:
    """``(build, filter)`` of transformers' model for a variant (``AutoModel``'s of its config, built from the
    registered model's shapes by ``config(variant, shapes)``): the filter is transformers' own loading (``from_pretrained`` of a folder holding the
    tensors, with every rename its version applies), strict. The model's ``forward_features(x)`` and ``forward(x)``
    are its normed token sequence ``(B, N, C)``; its ``dynamic_img_size`` is ``any_size``: whether it computes timm's
    function at every input size (rotary positions), not only at the variant's (a position embedding it resamples
    its own way).

    Raises:
        RemapError: transformers is not installed, or the tensors leave keys of its model missing or unexpected.
    """
    try:
        import transformers
    except ImportError:
        raise RemapError(
            "verifying a transformers layout needs transformers: pip install 'timm-layerscale[transformers]', "
            f"or pass {option('no_verify')}"
        ) from None
    import tempfile

    from safetensors.torch import save_file
    from torch import nn

    from . import state_dict_shapes

    cfg = config(variant, state_dict_shapes(variant, 0))
    cls = transformers.AutoModel

    class Backbone(nn.Module):
        """transformers' model, its normed tokens as ``forward_features`` and ``forward``."""

        def __init__(self) -> None:
            super().__init__()
            self.model = cls.from_config(cfg)
            # what verification and the report read of a model's attention (timm's flag)
            self.fused_attn = self.model.config._attn_implementation == "sdpa"
            self.dynamic_img_size = any_size

        def forward_features(self, x: Any) -> Any:
            return self.model(pixel_values=x).last_hidden_state

        forward = forward_features

    def load(state_dict: dict[str, Any], model: nn.Module) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as folder:
            cfg.save_pretrained(folder)
            save_file({k: v.contiguous() for k, v in state_dict.items()}, f"{folder}/model.safetensors")
            loaded, info = cls.from_pretrained(folder, output_loading_info=True)
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise RemapError(f"transformers' {type(loaded).__name__} does not take these tensors: {bad}")
        return {f"model.{k}": v for k, v in loaded.state_dict().items()}

    return Backbone, load
