"""CaiT with LayerScale modules (``ls1.gamma`` / ``ls2.gamma``).

Paper: Touvron et al., "Going deeper with Image Transformers", ICCV 2021,
https://arxiv.org/abs/2103.17239

The architecture and numbers are those of the official CaiT models (and of timm's
``cait_*``, which reproduces them): talking-heads self-attention blocks followed by
two class-attention blocks, each residual branch gated by LayerScale. The difference
is the parameter layout: LayerScale is a :class:`timm_layerscale.LayerScale` module,
as in timm's ViT/DeiT-III, instead of raw ``gamma_1`` / ``gamma_2`` parameters.
Pretrained weights are the official ones (``fb_dist_in1k``), remapped at load time.

Beyond timm's CaiT: ``dynamic_img_size=True`` and pretrained loading at another
``img_size`` (the position embedding is resampled).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, List, Optional, Tuple, Type, Union

import torch
import torch.nn as nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import Mlp, PatchEmbed, resample_abs_pos_embed, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from timm.models._manipulate import checkpoint as grad_checkpoint
from timm.models._manipulate import checkpoint_seq

from ..conversion.families import CAIT_RELEASE_URL, Variant, variants_of
from ..conversion.fold import fold_state_dict
from ..layer_scale import LayerScale, cait_init_value
from ..layers.block import PreNormBlock
from ..layers.class_attn import ClassAttn, LayerScaleBlockClassAttn
from ..layers.talking_heads import (
    ATTN_IMPLS,
    BufferedTalkingHeadAttn,
    FastTalkingHeadAttn,
    TalkingHeadAttn,
    attention_workspace,
)
from ..conversion.keys import to_layerscale, unwrap_state_dict

__all__ = [
    "CaitLS",
    "TalkingHeadAttn",
    "BufferedTalkingHeadAttn",
    "FastTalkingHeadAttn",
    "ClassAttn",
    "LayerScaleBlock",
    "LayerScaleBlockClassAttn",
]

InitValues = Union[float, str, None]


def _linear_flops(linear: nn.Linear, tokens: int) -> int:
    return tokens * linear.in_features * linear.out_features


def _block_tail_flops(blk: nn.Module, tokens: int) -> int:
    """MLP linears and LayerScale multiplies of a block whose branches see ``tokens`` tokens."""
    total = sum(_linear_flops(m, tokens) for m in blk.mlp.modules() if isinstance(m, nn.Linear))
    for ls in (blk.ls1, blk.ls2):
        if isinstance(ls, LayerScale):
            total += ls.flop_count(tokens)
    return total


class LayerScaleBlock(PreNormBlock):
    """Self-attention block: :class:`~timm_layerscale.layers.block.PreNormBlock` with talking-heads attention by default."""

    def __init__(
        self, dim: int, num_heads: int, attn_layer: Callable[..., nn.Module] = BufferedTalkingHeadAttn, **kwargs: Any
    ) -> None:
        super().__init__(dim, num_heads, attn_layer, **kwargs)


class CaitLS(nn.Module):
    """CaiT (Class-Attention in Image Transformers) with LayerScale modules.

    Args:
        img_size: Input resolution (pixels) the position embedding is built for.
        patch_size: Patch size (pixels).
        in_chans: Input channels.
        num_classes: Classifier outputs; 0 for no classifier.
        global_pool: ``'token'`` (class token), ``'avg'`` (mean of patch tokens) or ``''``.
        embed_dim: Token width ``C``.
        depth: Number of self-attention (talking-heads) blocks.
        num_heads: Attention heads ``H``; ``C`` must be divisible by it.
        mlp_ratio: MLP hidden width as a multiple of ``C``.
        qkv_bias: Bias on the q/k/v projections.
        drop_rate: Dropout before the classifier.
        pos_drop_rate: Dropout after adding the position embedding.
        proj_drop_rate: Dropout after attention projections and MLPs.
        attn_drop_rate: Dropout on attention weights.
        drop_path_rate: Stochastic depth rate (the same for every block, as in CaiT).
        init_values: LayerScale initial value; ``"auto"`` uses :func:`cait_init_value`
            of ``depth``; ``None`` disables LayerScale (``nn.Identity``).
        depth_token_only: Number of class-attention blocks.
        mlp_ratio_token_only: MLP ratio of the class-attention blocks.
        dynamic_img_size: Accept any input size divisible by the patch size; the
            position embedding is resampled on the fly.
        dynamic_img_pad: Pad inputs to a multiple of the patch size.
        attn_impl: Talking-heads attention implementation (``attn_layer`` overrides it):
            ``"buffered"`` (default; CPU inference in reused buffers, bit-identical to
            ``"reference"``), ``"reference"`` (timm's formulation) or ``"fast"`` (fewer
            copies, within :data:`~timm_layerscale.layers.talking_heads.FAST_ATTN_RTOL`
            of the reference, not bit-exact). All three train identically.
        fused_layerscale: Build without LayerScale modules (``ls1`` / ``ls2`` are
            ``nn.Identity``, ``init_values`` is ignored), for weights whose gammas were
            folded into ``attn.proj`` and ``mlp.fc2`` (:func:`timm_layerscale.fuse_layerscale`).
        norm_layer, act_layer, block_layer, block_layer_token, attn_layer,
        attn_layer_token_only, mlp_layer, embed_layer: Layer types.
        device: Device to build on (``"meta"`` allowed).
        dtype: Parameter dtype.
    """

    dynamic_img_size: torch.jit.Final[bool]

    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        init_values: InitValues = 1e-4,
        depth_token_only: int = 2,
        mlp_ratio_token_only: float = 4.0,
        dynamic_img_size: bool = False,
        dynamic_img_pad: bool = False,
        fused_layerscale: bool = False,
        norm_layer: Callable[..., nn.Module] = partial(nn.LayerNorm, eps=1e-6),
        act_layer: Type[nn.Module] = nn.GELU,
        block_layer: Type[nn.Module] = LayerScaleBlock,
        block_layer_token: Type[nn.Module] = LayerScaleBlockClassAttn,
        attn_layer: Optional[Type[nn.Module]] = None,
        attn_impl: str = "buffered",
        attn_layer_token_only: Type[nn.Module] = ClassAttn,
        mlp_layer: Type[nn.Module] = Mlp,
        embed_layer: Type[nn.Module] = PatchEmbed,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if global_pool not in ("", "token", "avg"):
            raise ValueError(f"global_pool must be 'token', 'avg' or '', got {global_pool!r}")
        if init_values == "auto":
            init_values = cait_init_value(depth)
        elif isinstance(init_values, str):
            raise ValueError(f"init_values must be a number, 'auto' or None, got {init_values!r}")
        if fused_layerscale:
            init_values = None
        if attn_layer is None:
            if attn_impl not in ATTN_IMPLS:
                raise ValueError(f"attn_impl must be one of {', '.join(map(repr, ATTN_IMPLS))}, got {attn_impl!r}")
            attn_layer = ATTN_IMPLS[attn_impl]

        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.dynamic_img_size = dynamic_img_size
        self.init_values = init_values
        self.fused_layerscale = fused_layerscale
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
        num_patches = self.patch_embed.num_patches
        r = self.patch_embed.feat_ratio() if hasattr(self.patch_embed, "feat_ratio") else patch_size

        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim, **dd))
        self.pos_embed = nn.Parameter(torch.empty(1, num_patches, embed_dim, **dd))
        self.pos_drop = nn.Dropout(p=pos_drop_rate)

        self.blocks = nn.Sequential(*[
            block_layer(
                dim=embed_dim,
                num_heads=num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=drop_path_rate,
                init_values=init_values,
                act_layer=act_layer,
                norm_layer=norm_layer,
                attn_layer=attn_layer,
                mlp_layer=mlp_layer,
                **dd,
            )
            for _ in range(depth)
        ])
        self.feature_info = [dict(num_chs=embed_dim, reduction=r, module=f"blocks.{i}") for i in range(depth)]
        self.blocks_token_only = nn.ModuleList([
            block_layer_token(
                dim=embed_dim,
                num_heads=num_heads,
                mlp_ratio=mlp_ratio_token_only,
                qkv_bias=qkv_bias,
                init_values=init_values,
                act_layer=act_layer,
                norm_layer=norm_layer,
                attn_layer=attn_layer_token_only,
                mlp_layer=mlp_layer,
                **dd,
            )
            for _ in range(depth_token_only)
        ])
        self.norm = norm_layer(embed_dim, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()
        if not self.pos_embed.is_meta:  # a meta build is filled by load_state_dict or init_weights() later
            self.init_weights()

    def init_weights(self) -> None:
        """Initialise as CaiT does: truncated normal (std 0.02) for embeddings and
        linear weights, zero biases, unit LayerNorm, LayerScale at ``init_values``."""
        trunc_normal_(self.pos_embed, std=0.02)
        trunc_normal_(self.cls_token, std=0.02)
        self.apply(self._init_module)

    @staticmethod
    def _init_module(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, LayerScale):
            m.reset_parameters()

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Callable[[str], float]:
        def _matcher(name: str) -> float:
            if name.startswith(("cls_token", "pos_embed", "patch_embed")):
                return 0
            if name.startswith("blocks."):
                return int(name.split(".")[1]) + 1
            if name.startswith("blocks_token_only."):
                # class-attention blocks share groups with the last self-attention blocks
                offset = len(self.blocks) - len(self.blocks_token_only) + 1
                return int(name.split(".")[1]) + offset
            if name.startswith("norm."):
                return len(self.blocks)
            return float("inf")

        return _matcher

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """Replace the classifier with a new one of ``num_classes`` outputs (0 removes it)."""
        if global_pool is not None:
            if global_pool not in ("", "token", "avg"):
                raise ValueError(f"global_pool must be 'token', 'avg' or '', got {global_pool!r}")
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

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        if self.dynamic_img_size:
            B, H, W, C = x.shape
            pos_embed = resample_abs_pos_embed(
                self.pos_embed, new_size=(H, W), old_size=self.patch_embed.grid_size, num_prefix_tokens=0
            )
            x = x.view(B, -1, C)
        else:
            pos_embed = self.pos_embed
        return self.pos_drop(x + pos_embed)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Forward pass that also returns the outputs of selected self-attention blocks.

        Args:
            x: Images ``(B, C_in, H_img, W_img)``.
            indices: Last ``n`` blocks if an int, all if ``None``, else these block indices.
            norm: Apply the final norm to each intermediate.
            stop_early: Stop after the last requested block (needs ``intermediates_only``).
            output_fmt: ``'NCHW'`` (``(B, C, H, W)`` patch grids) or ``'NLC'`` (``(B, N, C)``).
            intermediates_only: Return only the intermediates.

        Returns:
            The intermediates, or ``(final_tokens (B, 1 + N, C), intermediates)``.
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        reshape = output_fmt == "NCHW"
        intermediates = []
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)

        B, _, height, width = x.shape
        x = self._pos_embed(self.patch_embed(x))
        if torch.jit.is_scripting() or not stop_early:
            blocks = self.blocks
        else:
            blocks = self.blocks[: max_index + 1]
        with attention_workspace():
            for i, blk in enumerate(blocks):
                if self.grad_checkpointing and not torch.jit.is_scripting():
                    x = grad_checkpoint(blk, x)
                else:
                    x = blk(x)
                if i in take_indices:
                    intermediates.append(self.norm(x) if norm else x)

        if reshape:
            H, W = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if intermediates_only:
            return intermediates
        if self.blocks_token_only is not None:
            x = self.forward_cls(x)
        x = self.norm(x)
        return x, intermediates

    def prune_intermediate_layers(
        self,
        indices: Union[int, List[int]] = 1,
        prune_norm: bool = False,
        prune_head: bool = True,
    ) -> List[int]:
        """Drop the blocks (and optionally norm, class attention and head) not needed for ``indices``."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.blocks_token_only = None
            self.cls_token = None
            self.num_prefix_tokens = 0
            self.reset_classifier(0, "")
        return take_indices

    def forward_cls(self, x: torch.Tensor) -> torch.Tensor:
        """Run the class token through the class-attention blocks and prepend it.

        Args: x: patch tokens ``(B, N, C)``. Returns: ``(B, 1 + N, C)``.
        """
        cls_tokens = self.cls_token.expand(x.shape[0], -1, -1)
        for blk in self.blocks_token_only:
            cls_tokens = blk(x, cls_tokens)
        return torch.cat((cls_tokens, x), dim=1)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C_in, H, W)`` to normalised tokens ``(B, 1 + N, C)``, class token first."""
        x = self._pos_embed(self.patch_embed(x))
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            with attention_workspace():
                x = self.blocks(x)
        if self.blocks_token_only is not None:
            x = self.forward_cls(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens ``(B, 1 + N, C)`` to logits ``(B, num_classes)`` (or pooled ``(B, C)``)."""
        if self.global_pool:
            x = x[:, self.num_prefix_tokens:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def flop_count(self, batch_size: int = 1) -> int:
        """Multiplications of one forward pass at the model's ``img_size``.

        Multiply-only convention, as :meth:`LayerScale.flop_count`: a multiply-add
        counts 1 (``torch.utils.flop_counter.FlopCounterMode`` counts it 2). Counted:
        the patch-embedding conv; every linear layer (``qkv``, ``proj``, the MLPs, the
        class-attention ``q`` / ``k`` / ``v`` / ``proj`` and the classifier); ``q @ k^T``
        and ``attn @ v`` (``N^2 C`` each in a self-attention block, ``(1 + N) C`` in a
        class-attention block); the talking-heads mixes ``proj_l`` and ``proj_w``
        (``H^2`` per entry of the ``N x N`` logits); LayerScale (``tokens * C`` per
        module; none when ``fused_layerscale``). Not counted: norms, softmax, GELU,
        the attention scale, bias, residual and position-embedding additions. Inputs
        of another size (``dynamic_img_size``) are not accounted for.

        Args:
            batch_size: Images per forward pass.

        Returns:
            The count for ``batch_size`` images.
        """
        n = self.patch_embed.num_patches
        conv = self.patch_embed.proj
        kh, kw = conv.kernel_size
        total = n * conv.out_channels * (conv.in_channels // conv.groups) * kh * kw
        for blk in self.blocks:
            attn = blk.attn
            total += _linear_flops(attn.qkv, n) + _linear_flops(attn.proj, n)
            total += 2 * n * n * attn.num_heads * attn.head_dim
            total += 2 * n * n * attn.num_heads * attn.num_heads
            total += _block_tail_flops(blk, n)
        for blk in self.blocks_token_only or ():
            attn = blk.attn
            total += _linear_flops(attn.q, 1) + _linear_flops(attn.k, n + 1) + _linear_flops(attn.v, n + 1)
            total += 2 * (n + 1) * attn.num_heads * attn.head_dim
            total += _linear_flops(attn.proj, 1)
            total += _block_tail_flops(blk, 1)
        if isinstance(self.head, nn.Linear):
            total += _linear_flops(self.head, 1)
        return int(total) * int(batch_size)


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: CaitLS) -> dict[str, torch.Tensor]:
    """Turn any CaiT checkpoint into this model's layout.

    Accepts the official file (``{'model': {'module.' + key: ...}}``), timm's
    ``cait_*`` state dict (``gamma_1``/``gamma_2``) and the ``ls`` layout. The
    position embedding is resampled when the checkpoint's grid differs from the
    model's (pretrained loading at another ``img_size``). For a model built with
    ``fused_layerscale=True`` the gammas are folded into ``attn.proj`` and ``mlp.fc2``
    (:func:`timm_layerscale.conversion.fold.fold_state_dict`).
    """
    out = to_layerscale(unwrap_state_dict(state_dict), "cait")
    pe = out.get("pos_embed")
    if pe is not None and pe.shape != model.pos_embed.shape:
        out["pos_embed"] = resample_abs_pos_embed(
            pe, new_size=model.patch_embed.grid_size, num_prefix_tokens=0, verbose=False
        )
    if model.fused_layerscale:
        out = fold_state_dict(out)
    return out


def _create_cait_ls(variant: str, pretrained: bool = False, **kwargs: Any) -> CaitLS:
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        CaitLS,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )


#: The registered variants (:data:`timm_layerscale.conversion.families.VARIANTS`).
VARIANTS = variants_of("cait")


def _cfg(v: Variant) -> dict[str, Any]:
    return {
        "url": CAIT_RELEASE_URL + str(v.official_file),
        "hf_hub_id": f"timm/{v.reference}.fb_dist_in1k",
        "num_classes": 1000,
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
        "paper_ids": "arXiv:2103.17239",
        "paper_name": "Going deeper with Image Transformers",
        "origin_url": "https://github.com/facebookresearch/deit",
    }


default_cfgs = generate_default_cfgs({f"{name}.fb_dist_in1k": _cfg(v) for name, v in VARIANTS.items()})


def _make(name: str, pretrained: bool, kwargs: dict[str, Any]) -> CaitLS:
    return _create_cait_ls(name, pretrained=pretrained, **dict(VARIANTS[name].model_args, **kwargs))


@register_model
def cait_xxs24_224_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_xxs24_224_ls", pretrained, kwargs)


@register_model
def cait_xxs24_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_xxs24_384_ls", pretrained, kwargs)


@register_model
def cait_xxs36_224_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_xxs36_224_ls", pretrained, kwargs)


@register_model
def cait_xxs36_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_xxs36_384_ls", pretrained, kwargs)


@register_model
def cait_xs24_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_xs24_384_ls", pretrained, kwargs)


@register_model
def cait_s24_224_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_s24_224_ls", pretrained, kwargs)


@register_model
def cait_s24_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_s24_384_ls", pretrained, kwargs)


@register_model
def cait_s36_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_s36_384_ls", pretrained, kwargs)


@register_model
def cait_m36_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_m36_384_ls", pretrained, kwargs)


@register_model
def cait_m48_448_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_m48_448_ls", pretrained, kwargs)
