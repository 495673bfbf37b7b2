"""ViT-5: a LayerScale Vision Transformer with RMSNorm, QK-norm, registers and 2-D RoPE.

Paper: Wang et al., "ViT-5: Vision Transformers for the Mid-2020s", arXiv 2602.08071,
https://arxiv.org/abs/2602.08071

Official code: https://github.com/wangf3014/ViT-5 (``models_vit5.py``, ``rope.py``);
weights: https://huggingface.co/FengWang3211/ViT-5 (``vit5_{size}_patch16_{img}.pth``,
training dicts holding ``'model'``, ``'model_ema'`` and the optimizer state).

The architecture and numbers are the official model's: patch 16, RMSNorm (eps 1e-6,
weight only) before attention and MLP and as QK-norm, no qkv bias, a learned absolute
position embedding on the patch tokens, four register tokens *after* the patch tokens,
2-D rotary embeddings on q/k (after the QK-norm), GELU MLP, LayerScale (init 1e-4) on
both residual branches, class-token head. The token order is
``[cls, patches..., registers...]``.

Rotary embedding, exactly as the official code computes it: for a head width ``d`` each
axis has ``d / 4`` frequencies ``theta ** (-2i / (d / 2))``; a token at row ``r``,
column ``c`` of an ``H x W`` grid has positions ``r / H * H_ref`` and ``c / W * W_ref``
(``H_ref x W_ref`` is the grid of the model's ``img_size``, so positions stay in the
training range at other resolutions); the angles of the row axis fill the first half of
the head, those of the column axis the second half, each frequency used for one pair of
adjacent (interleaved) channels. Patches use ``theta = 10000`` on the patch grid,
registers ``theta = 100`` on a 2 x 2 grid, the class token is not rotated, v is never
rotated. The tables are computed, not stored: the official ``*.freqs`` buffers are
checked against them and dropped on loading.

Differences from the official code are layout only: LayerScale is a
:class:`~timm_layerscale.layer_scale.LayerScale` module (``ls1.gamma`` / ``ls2.gamma``) instead of
raw ``gamma_1`` / ``gamma_2`` parameters, and one rotary module per model replaces the
per-block ``rope`` / ``rope_reg`` buffers. Beyond the official model: ``dynamic_img_size``,
non-square grids, pretrained loading at another ``img_size`` (the position embedding is
resampled), timm's feature-extraction API.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from timm.layers import Mlp, PatchEmbed
from timm.models import generate_default_cfgs, register_model
from timm.models._manipulate import checkpoint as grad_checkpoint

from ..conversion.keys import WRAPPER_KEYS, state_dict_of, to_layerscale
from ..families import (
    DEFAULT_NUM_CLASSES,
    VIT5_HUB_REPO,
    VIT5_ROPE_THETA,
    Variant,
    check_rope_buffers,
    rope_buffers,
    variants_of,
)
from ..layer_scale import LayerScale
from ..layers.rope import RopeTables, Vit5RotaryEmbedding, apply_rope
from ..layers.rope_attention import Vit5Attention, Vit5Block, rms_norm
from ._contract import (
    TimmContract,
    block_tail_flops,
    build_variant,
    fit_state_dict,
    pretrained_cfg,
    self_attention_flops,
)

__all__ = [
    "Vit5",
    "Vit5Attention",
    "Vit5Block",
    "Vit5RotaryEmbedding",
    "apply_rope",
]


class Vit5(TimmContract):
    """ViT-5 with LayerScale modules.

    Args:
        img_size: Input resolution (pixels); sets the position-embedding grid and the
            rotary reference grid.
        patch_size: Patch size (pixels).
        in_chans: Input channels.
        num_classes: Classifier outputs; 0 for no classifier.
        global_pool: ``'token'`` (class token), ``'avg'`` (mean of patch tokens) or ``''``.
        embed_dim: Token width ``C``.
        depth: Number of blocks.
        num_heads: Attention heads; ``C / num_heads`` must be a multiple of 4.
        mlp_ratio: MLP hidden width as a multiple of ``C``.
        qkv_bias: Bias on the qkv projection (off in ViT-5).
        qk_norm: RMSNorm on q and k per head.
        reg_tokens: Register tokens, appended after the patch tokens; a square number
            (their rotary grid is ``sqrt x sqrt``), 0 for none.
        rope_theta: Rotary base of the patch tokens.
        reg_rope_theta: Rotary base of the register tokens.
        init_values: LayerScale initial value; ``None`` disables LayerScale (``nn.Identity``).
        folded_layerscale: Build without LayerScale modules (``ls1`` / ``ls2`` are
            ``nn.Identity``), for weights whose gammas were folded into ``attn.proj`` and
            ``mlp.fc2``; pretrained weights are folded on loading.
        drop_rate: Dropout before the classifier.
        proj_drop_rate: Dropout after the attention projection and in the MLP.
        attn_drop_rate: Dropout on attention weights.
        drop_path_rate: Stochastic depth rate, the same for every block (as in ViT-5).
        dynamic_img_size: Accept any input size divisible by the patch size; the position
            embedding is resampled and the rotary positions rescaled on the fly.
        dynamic_img_pad: Pad inputs to a multiple of the patch size.
        norm_layer: Norm layer; ``None`` for RMSNorm with eps 1e-6.
        act_layer: MLP activation.
        block_layer: Block type.
        attn_layer: Attention type.
        mlp_layer: MLP type.
        embed_layer: Patch embedding type.
        device: Device to build on (``"meta"`` allowed).
        dtype: Parameter dtype.
    """

    embedding_names = ("pos_embed", "cls_token", "reg_token")
    if TYPE_CHECKING:  # not at run time: see TimmContract
        cls_token: nn.Parameter

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = DEFAULT_NUM_CLASSES,
        global_pool: str = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        qk_norm: bool = True,
        reg_tokens: int = 4,
        rope_theta: float = 10000.0,
        reg_rope_theta: float = 100.0,
        init_values: float | None = 1e-4,
        folded_layerscale: bool = False,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        dynamic_img_size: bool = False,
        dynamic_img_pad: bool = False,
        norm_layer: Callable[..., nn.Module] | None = None,
        act_layer: type[nn.Module] = nn.GELU,
        block_layer: type[nn.Module] = Vit5Block,
        attn_layer: type[nn.Module] = Vit5Attention,
        mlp_layer: type[nn.Module] = Mlp,
        embed_layer: Callable[..., PatchEmbed] = PatchEmbed,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        reg_side = round(reg_tokens**0.5)
        if reg_tokens < 0 or reg_side * reg_side != reg_tokens:
            raise ValueError(f"reg_tokens must be a square number (0, 1, 4, 9, ...), got {reg_tokens}")
        norm_layer = norm_layer or rms_norm()

        self._build_stem(
            img_size,
            patch_size,
            in_chans,
            num_classes,
            global_pool,
            embed_dim,
            None if folded_layerscale else init_values,
            folded_layerscale,
            dynamic_img_size,
            dynamic_img_pad,
            embed_layer,
            **dd,
        )
        self.num_reg_tokens = reg_tokens
        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim, **dd))
        self.reg_token = nn.Parameter(torch.empty(1, reg_tokens, embed_dim, **dd)) if reg_tokens else None
        self.pos_embed = nn.Parameter(torch.empty(1, self.patch_embed.num_patches, embed_dim, **dd))

        head_dim = embed_dim // num_heads
        self.rope = Vit5RotaryEmbedding(head_dim, tuple(self.patch_embed.grid_size), theta=rope_theta)
        self.rope_reg = (
            Vit5RotaryEmbedding(head_dim, (reg_side, reg_side), theta=reg_rope_theta) if reg_tokens else None
        )

        self.blocks = nn.ModuleList(
            [
                block_layer(
                    dim=embed_dim,
                    num_heads=num_heads,
                    mlp_ratio=mlp_ratio,
                    qkv_bias=qkv_bias,
                    qk_norm=qk_norm,
                    proj_drop=proj_drop_rate,
                    attn_drop=attn_drop_rate,
                    drop_path=drop_path_rate,
                    init_values=self.init_values,
                    act_layer=act_layer,
                    norm_layer=norm_layer,
                    attn_layer=attn_layer,
                    mlp_layer=mlp_layer,
                    **dd,
                )
                for _ in range(depth)
            ]
        )
        self._build_head(depth, patch_size, drop_rate, norm_layer, **dd)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return dict(
            stem=r"^cls_token|^reg_token|^pos_embed|^patch_embed",
            blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))],
        )

    def _tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images to tokens ``[cls, patches + pos_embed, registers]`` and the patch grid."""
        x, grid = self._patch_tokens(x)
        tokens = [self.cls_token.expand(x.shape[0], -1, -1), x]
        if self.reg_token is not None:
            tokens.append(self.reg_token.expand(x.shape[0], -1, -1))
        return torch.cat(tokens, dim=1), grid

    def rope_tables(self, grid: tuple[int, int], device: torch.device | None = None) -> RopeTables:
        """Rotary ``(sin, cos)`` tables for every token of a ``grid`` input.

        Rows follow the token order: the class token (identity: sin 0, cos 1), the
        patches (row-major), the registers.

        Returns:
            ``(sin, cos)``, each fp32 ``(1 + H * W + reg_tokens, head_dim)``.
        """
        sin, cos = self.rope.get_embed(grid, device)
        sins = [sin.new_zeros(self.num_prefix_tokens, sin.shape[-1]), sin]
        coss = [cos.new_ones(self.num_prefix_tokens, cos.shape[-1]), cos]
        if self.rope_reg is not None:
            side = self.rope_reg.ref_grid
            reg_sin, reg_cos = self.rope_reg.get_embed(side, device)
            sins.append(reg_sin)
            coss.append(reg_cos)
        return torch.cat(sins), torch.cat(coss)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Any] | tuple[torch.Tensor, list[Any]]:
        """Forward pass that also returns the outputs of selected blocks.

        Intermediates hold the patch tokens only; the class token and the registers are
        returned beside them with ``return_prefix_tokens``.

        Args:
            x: Images ``(B, C_in, H_img, W_img)``.
            indices: Last ``n`` blocks if an int, all if ``None``, else these block indices.
            return_prefix_tokens: Return ``(patches, prefix)`` pairs, where ``prefix`` is
                ``(B, 1 + reg_tokens, C)``: the class token, then the registers.
            norm: Apply the final norm to each intermediate.
            stop_early: Stop after the last requested block (needs ``intermediates_only``).
            output_fmt: ``'NCHW'`` (``(B, C, H, W)`` patch grids) or ``'NLC'`` (``(B, H * W, C)``).
            intermediates_only: Return only the intermediates.

        Returns:
            The intermediates, or ``(final_tokens (B, 1 + H * W + reg_tokens, C), intermediates)``.
        """
        self._check_output_fmt(output_fmt)
        x, grid = self._tokens(x)
        x, intermediates = self._collect_intermediates(x, indices, norm, stop_early, self.rope_tables(grid, x.device))

        n_pre, n_reg = self.num_prefix_tokens, self.num_reg_tokens
        prefix = [torch.cat((y[:, :n_pre], y[:, y.shape[1] - n_reg :]), dim=1) for y in intermediates]
        patches = [y[:, n_pre : y.shape[1] - n_reg] for y in intermediates]
        if output_fmt == "NCHW":
            patches = self._to_nchw(patches, grid)
        out: list[Any] = list(zip(patches, prefix, strict=True)) if return_prefix_tokens else patches
        if intermediates_only:
            return out
        return self.norm(x), out

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C_in, H, W)`` to normalised tokens ``(B, 1 + N + reg_tokens, C)``: class, patches, registers."""
        x, grid = self._tokens(x)
        rope = self.rope_tables(grid, x.device)
        for blk in self.blocks:  # not _run_block: TorchScript passes no module as an argument
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = grad_checkpoint(blk, x, rope)
            else:
                x = blk(x, rope)
        return self.norm(x)

    def flop_count(self, batch_size: int = 1) -> int:
        """Multiplications of one forward pass at the model's ``img_size``.

        Multiply-only convention: a multiply-add counts 1 (tools that count 2 per
        multiply-add, such as ``torch.utils.flop_counter``, report twice this). Counted:
        the patch-embedding conv, the qkv / proj / MLP linears, ``q @ k^T`` and
        ``attn @ v``, the LayerScale multiplies (``tokens * C`` each) and the classifier
        (one token). Not counted: norms, softmax, the rotary embedding, GELU, biases,
        residual and position-embedding additions.

        Args:
            batch_size: Images per forward pass.

        Returns:
            The count for ``batch_size`` images.
        """
        n = self.num_prefix_tokens + self.patch_embed.num_patches + self.num_reg_tokens
        total = sum(self_attention_flops(blk.attn, n) + block_tail_flops(blk, n) for blk in self.blocks)
        return self._flop_total(total, batch_size)


def _official_rope(model: Vit5) -> dict[str, torch.Tensor]:
    """The rotary buffers an official checkpoint of ``model``'s shape holds."""
    reg_theta = model.rope_reg.theta if model.rope_reg is not None else VIT5_ROPE_THETA[1]
    return rope_buffers(len(model.blocks), model.rope.head_dim, (model.rope.theta, reg_theta))


def _wants_ema(model: nn.Module) -> bool:
    tag = (getattr(model, "pretrained_cfg", None) or {}).get("tag") or ""
    return tag.endswith("_ema")


def checkpoint_filter_fn(
    state_dict: Mapping[str, Any], model: Vit5, use_ema: bool | None = None
) -> dict[str, torch.Tensor]:
    """Turn any ViT-5 checkpoint into this model's layout.

    Accepts the official training dict (``{'model': ..., 'model_ema': ..., 'optimizer': ...}``),
    a bare official state dict (``gamma_1`` / ``gamma_2``, ``*.freqs`` buffers) and the
    ``ls`` layout. From a training dict it takes ``'model'`` (the weights the paper
    evaluates) unless EMA weights are asked for: ``use_ema=True``, or a pretrained tag
    ending in ``_ema`` (``vit5_base_patch16_224.in1k_ema``). A bare state dict is taken
    as it is; note that timm's own loader for ``pretrained_cfg_overlay=dict(file=...)``
    unwraps a training dict itself before this filter runs, preferring ``'model_ema'``.

    The rotary buffers are checked against the computed tables
    (:class:`~timm_layerscale.errors.RemapError` if they differ) and dropped; the position
    embedding is resampled when the checkpoint's grid differs from the model's;
    LayerScale is folded into ``attn.proj`` / ``mlp.fc2`` when the model has none
    (``folded_layerscale``).
    """
    if use_ema is None:
        use_ema = _wants_ema(model)
    wrapped = any(k in state_dict for k in WRAPPER_KEYS)
    sd = state_dict_of(state_dict, ema=bool(use_ema and wrapped))
    check_rope_buffers(sd, _official_rope(model))
    return fit_state_dict(to_layerscale(sd, "vit5"), model, fold=not isinstance(model.blocks[0].ls1, LayerScale))


def _cfg(v: Variant, **kwargs: Any) -> dict[str, Any]:
    file = v.official_file
    return pretrained_cfg(
        v,
        url="",
        hf_hub_id=VIT5_HUB_REPO if file else None,
        hf_hub_filename=file or None,
        paper_ids="arXiv:2602.08071",
        paper_name="ViT-5: Vision Transformers for the Mid-2020s",
        origin_url="https://github.com/wangf3014/ViT-5",
        **kwargs,
    )


_EMA_NOTE = ("EMA weights ('model_ema') of the released training checkpoint",)


def _tags(v: Variant) -> dict[str, dict[str, Any]]:
    if v.official_file is None:
        return {v.name: _cfg(v)}
    return {f"{v.name}.in1k": _cfg(v), f"{v.name}.in1k_ema": _cfg(v, notes=_EMA_NOTE)}


#: The registered variants (:data:`timm_layerscale.families.VARIANTS`).
VARIANTS = variants_of("vit5")

default_cfgs = generate_default_cfgs({tag: cfg for v in VARIANTS.values() for tag, cfg in _tags(v).items()})


def _make(name: str, pretrained: bool, kwargs: dict[str, Any]) -> Vit5:
    return build_variant(Vit5, checkpoint_filter_fn, VARIANTS[name], pretrained, kwargs)


@register_model
def vit5_small_patch16_224(pretrained: bool = False, **kwargs: Any) -> Vit5:
    return _make("vit5_small_patch16_224", pretrained, kwargs)


@register_model
def vit5_base_patch16_224(pretrained: bool = False, **kwargs: Any) -> Vit5:
    return _make("vit5_base_patch16_224", pretrained, kwargs)


@register_model
def vit5_base_patch16_384(pretrained: bool = False, **kwargs: Any) -> Vit5:
    return _make("vit5_base_patch16_384", pretrained, kwargs)


@register_model
def vit5_large_patch16_224(pretrained: bool = False, **kwargs: Any) -> Vit5:
    return _make("vit5_large_patch16_224", pretrained, kwargs)


@register_model
def vit5_large_patch16_384(pretrained: bool = False, **kwargs: Any) -> Vit5:
    return _make("vit5_large_patch16_384", pretrained, kwargs)


@register_model
def vit5_xlarge_patch16_224(pretrained: bool = False, **kwargs: Any) -> Vit5:
    return _make("vit5_xlarge_patch16_224", pretrained, kwargs)
