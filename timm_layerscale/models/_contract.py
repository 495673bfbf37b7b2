"""What timm expects of a model, for the package's ViT-shaped models.

:class:`~timm_layerscale.models.cait_ls.CaitLS` and :class:`~timm_layerscale.models.vit5.Vit5`
have a ``patch_embed``, a learned ``pos_embed`` on the patch tokens, a class token,
``blocks``, a final ``norm``, ``head_drop`` and a linear ``head``.
:class:`TimmContract` holds the methods timm's training, feature-extraction and
fine-tuning code calls on them; the functions below build the parts, checkpoints,
registered variants and operation counts the model files share.
"""

# Annotations here are evaluated, not postponed: an FX trace copies forward's into the graph's
# code, and TorchScript cannot read a postponed one there.
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import PatchEmbed, RmsNorm, resample_abs_pos_embed, trunc_normal_
from timm.models import build_model_with_cfg
from timm.models._features import feature_take_indices
from timm.models._manipulate import checkpoint as grad_checkpoint

from ..conversion.fold import fold_state_dict
from ..families import DEFAULT_NUM_CLASSES, Variant
from ..layer_scale import LayerScale

__all__ = [
    "TimmContract",
    "block_tail_flops",
    "build_variant",
    "fit_state_dict",
    "linear_flops",
    "pretrained_cfg",
    "self_attention_flops",
]


def check_global_pool(global_pool: str) -> None:
    if global_pool not in ("", "token", "avg"):
        raise ValueError(f"global_pool must be 'token', 'avg' or '', got {global_pool!r}")


class TimmContract(nn.Module):
    """Base of the ViT-shaped models: the methods timm calls on a model.

    A model calls ``_build_stem`` first in its constructor (attributes and
    ``patch_embed``), makes its tokens, position embedding and blocks, and ends with
    ``_build_head`` (``feature_info``, ``norm``, ``head_drop``, ``head``, weights);
    it defines ``forward_features`` and ``forward_intermediates``.
    """

    #: Parameters initialised with a truncated normal and kept out of weight decay, in init order.
    embedding_names: tuple[str, ...] = ("pos_embed", "cls_token")
    # For type checkers only: TorchScript takes class annotations for attribute types and cannot
    # read these postponed (string) ones.
    if TYPE_CHECKING:
        #: Tokens after the patch tokens (registers), left out of average pooling.
        num_reg_tokens: int
        num_classes: int
        in_chans: int
        global_pool: str
        num_features: int
        head_hidden_size: int
        embed_dim: int
        num_prefix_tokens: int
        dynamic_img_size: bool
        init_values: float | None
        folded_layerscale: bool
        grad_checkpointing: bool
        patch_embed: PatchEmbed
        pos_embed: nn.Parameter
        cls_token: nn.Parameter | None
        blocks: nn.Sequential | nn.ModuleList
        feature_info: list[dict[str, Any]]
        norm: nn.Module
        head_drop: nn.Dropout
        head: nn.Module

    def _build_stem(
        self,
        img_size: int | tuple[int, int],
        patch_size: int,
        in_chans: int,
        num_classes: int,
        global_pool: str,
        embed_dim: int,
        init_values: float | None,
        folded_layerscale: bool,
        dynamic_img_size: bool,
        dynamic_img_pad: bool,
        embed_layer: Callable[..., PatchEmbed],
        **dd: Any,
    ) -> None:
        check_global_pool(global_pool)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.num_reg_tokens = 0
        self.dynamic_img_size = dynamic_img_size
        self.init_values = init_values
        self.folded_layerscale = folded_layerscale
        self.grad_checkpointing = False
        embed_args: dict[str, Any] = {}
        if dynamic_img_size:
            embed_args.update(strict_img_size=False, output_fmt="NHWC")
        self.patch_embed = embed_layer(
            img_size=img_size,
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            dynamic_img_pad=dynamic_img_pad,
            **embed_args,
            **dd,
        )

    def _build_head(
        self, depth: int, patch_size: int, drop_rate: float, norm_layer: Callable[..., nn.Module], **dd: Any
    ) -> None:
        r = self.patch_embed.feat_ratio() if hasattr(self.patch_embed, "feat_ratio") else patch_size
        self.feature_info = [dict(num_chs=self.embed_dim, reduction=r, module=f"blocks.{i}") for i in range(depth)]
        self.norm = norm_layer(self.embed_dim, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.embed_dim, self.num_classes, **dd) if self.num_classes > 0 else nn.Identity()
        if not self.pos_embed.is_meta:  # a meta build is filled by load_state_dict or init_weights() later
            self.init_weights()

    def init_weights(self) -> None:
        """Initialise as CaiT and ViT-5 do: truncated normal (std 0.02) for the class,
        register and position embeddings and linear weights, zero biases, unit norm
        weights, LayerScale at ``init_values``; the patch-embedding conv keeps PyTorch's default."""
        for name in self.embedding_names:
            param = getattr(self, name)
            if param is not None:
                trunc_normal_(param, std=0.02)
        self.apply(_init_module)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return set(self.embedding_names)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier with a new one of ``num_classes`` outputs (0 removes it)."""
        if global_pool is not None:
            check_global_pool(global_pool)
            if global_pool == "token" and not self.num_prefix_tokens:
                raise ValueError("token pooling needs the class token, which was pruned")
            self.global_pool = global_pool
        self.num_classes = num_classes
        ref = self.norm.weight if isinstance(self.norm, nn.LayerNorm) else self.pos_embed
        self.head = (
            nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype)
            if num_classes > 0
            else nn.Identity()
        )
        self.head.train(self.training)

    def _patch_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images to patch tokens plus the position embedding ``(B, H * W, C)``, and the grid ``(H, W)``."""
        x = self.patch_embed(x)
        if self.dynamic_img_size:
            B, H, W, C = x.shape
            pos_embed = resample_abs_pos_embed(
                self.pos_embed, new_size=(H, W), old_size=self.patch_embed.grid_size, num_prefix_tokens=0
            )
            x = x.view(B, -1, C)
            grid = (H, W)
        else:
            pos_embed = self.pos_embed
            grid = tuple(self.patch_embed.grid_size)
        return x + pos_embed, grid

    def _run_block(self, blk: nn.Module, x: torch.Tensor, *args: Any) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return grad_checkpoint(blk, x, *args)
        return blk(x, *args)

    @staticmethod
    def _check_output_fmt(output_fmt: str) -> None:
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")

    @staticmethod
    def _to_nchw(tokens: Iterable[torch.Tensor], grid: tuple[int, int]) -> list[torch.Tensor]:
        """Patch tokens ``(B, H * W, C)`` to feature maps ``(B, C, H, W)``."""
        H, W = grid
        return [y.reshape(y.shape[0], H, W, y.shape[-1]).permute(0, 3, 1, 2).contiguous() for y in tokens]

    def _collect_intermediates(
        self, x: torch.Tensor, indices: int | list[int] | None, norm: bool, stop_early: bool, *args: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the blocks (``blk(x, *args)``), keeping the outputs of those ``indices`` selects.

        Returns:
            The last block's output and the kept outputs (through ``norm`` if asked).
        """
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        blocks = self.blocks if torch.jit.is_scripting() or not stop_early else self.blocks[: max_index + 1]
        intermediates = []
        for i, blk in enumerate(blocks):
            x = self._run_block(blk, x, *args)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)
        return x, intermediates

    def prune_intermediate_layers(
        self,
        indices: int | list[int] = 1,
        prune_norm: bool = False,
        prune_head: bool = True,
    ) -> list[int]:
        """Drop the blocks (and optionally the final norm and the head) not needed for ``indices``."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self._prune_head()
        return take_indices

    def _prune_head(self) -> None:
        self.reset_classifier(0, "")

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens ``(B, N, C)`` to logits ``(B, num_classes)`` (or pooled ``(B, C)``)."""
        if self.global_pool == "avg":
            x = x[:, self.num_prefix_tokens : x.shape[1] - self.num_reg_tokens].mean(dim=1)
        elif self.global_pool == "token":
            x = x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def _flop_total(self, block_flops: int, batch_size: int) -> int:
        """The patch-embedding conv, ``block_flops`` and the classifier (one token), for ``batch_size`` images."""
        total = _patch_embed_flops(self.patch_embed) + block_flops
        if isinstance(self.head, nn.Linear):
            total += linear_flops(self.head, 1)
        return int(total) * int(batch_size)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C_in, H, W)`` to normalised tokens ``(B, N, C)``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _init_module(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, (nn.LayerNorm, RmsNorm, LayerScale)):
        m.reset_parameters()


def fit_state_dict(state_dict: dict[str, torch.Tensor], model: TimmContract, fold: bool) -> dict[str, torch.Tensor]:
    """Resample ``pos_embed`` to the model's grid where it differs; fold LayerScale into the linears if ``fold``."""
    pe = state_dict.get("pos_embed")
    if pe is not None and pe.shape != model.pos_embed.shape:
        state_dict["pos_embed"] = resample_abs_pos_embed(
            pe, new_size=model.patch_embed.grid_size, num_prefix_tokens=0, verbose=False
        )
    return fold_state_dict(state_dict) if fold else state_dict


M = TypeVar("M", bound=TimmContract)


def build_variant(
    model_cls: type[M],
    filter_fn: Callable[..., Any],
    variant: Variant,
    pretrained: bool,
    kwargs: dict[str, Any],
) -> M:
    """Build a registered variant: its architecture arguments, overridden by ``kwargs``."""
    kwargs = dict(variant.model_args, **kwargs)
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        model_cls,
        variant.name,
        pretrained,
        pretrained_filter_fn=filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )


def pretrained_cfg(v: Variant, **kwargs: Any) -> dict[str, Any]:
    """The pretrained config of a variant: ImageNet-1k classifier at ``v.img_size``, plus ``kwargs``."""
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


def linear_flops(linear: nn.Linear, tokens: int) -> int:
    return tokens * linear.in_features * linear.out_features


def _patch_embed_flops(patch_embed: PatchEmbed) -> int:
    """The patch-embedding conv over every patch."""
    conv = patch_embed.proj
    kh, kw = conv.kernel_size
    return patch_embed.num_patches * conv.out_channels * (conv.in_channels // conv.groups) * kh * kw


def self_attention_flops(attn: Any, tokens: int) -> int:
    """The ``qkv`` and ``proj`` linears, ``q @ k^T`` and ``attn @ v`` of a self-attention
    over ``tokens`` tokens (any layer with ``qkv``, ``proj``, ``num_heads`` and ``head_dim``)."""
    total = linear_flops(attn.qkv, tokens) + linear_flops(attn.proj, tokens)
    return total + 2 * tokens * tokens * attn.num_heads * attn.head_dim


def block_tail_flops(blk: Any, tokens: int) -> int:
    """MLP linears and LayerScale multiplies of a block (``mlp``, ``ls1``, ``ls2``) whose branches see ``tokens`` tokens."""
    total = sum(linear_flops(m, tokens) for m in blk.mlp.modules() if isinstance(m, nn.Linear))
    for ls in (blk.ls1, blk.ls2):
        if isinstance(ls, LayerScale):
            total += ls.flop_count(tokens)
    return total
