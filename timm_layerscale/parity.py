"""Output parity between a reference model and a converted one, and its report.

The reference is the model that computes the released function from the original
weights: timm's ``cait_*`` for the LayerScale CaiT family (timm's CaiT equals the
official code bit for bit with fused attention off), timm's ``deit3_*`` for DeiT-III,
and an independent official-layout implementation for ViT-5. Both models see the
same inputs; the report states how far apart their outputs are.
"""
from __future__ import annotations

import math
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ._version import __version__

__all__ = [
    "ParityReport",
    "seed_parameters_",
    "seeded_inputs",
    "image_inputs",
    "compare_models",
    "attention_path",
]


@dataclass
class ParityReport:
    """How closely a converted model reproduces its reference.

    Attributes:
        reference: Name of the reference model.
        model: Name of the converted model.
        family: Model family.
        inputs: What the inputs were.
        num_inputs: Number of input images.
        dtype: dtype of both models and the inputs.
        device: Device both models ran on.
        attention: Attention path both models took.
        max_abs_diff: Largest ``|ref - out|`` over all logits.
        max_rel_diff: Largest ``|ref - out| / |ref|`` (0 where both are 0).
        cosine_min: Smallest per-image cosine similarity of the logit vectors.
        top1_agreement: Fraction of images with the same top-1 class.
        top5_agreement: Fraction of images with the same top-5 class set.
        bit_exact: Every output element is identical (``torch.equal``).
        atol: Absolute tolerance of the check (0 = exact).
        rtol: Relative tolerance of the check (0 = exact).
        passed: The check held: bit-exact when both tolerances are 0, else
            ``|ref - out| <= atol + rtol * |ref|`` everywhere.
        versions: Package, timm, torch and Python versions.
    """

    reference: str
    model: str
    family: str
    inputs: str
    num_inputs: int
    dtype: str
    device: str
    attention: str
    max_abs_diff: float
    max_rel_diff: float
    cosine_min: float
    top1_agreement: float
    top5_agreement: float
    bit_exact: bool
    atol: float
    rtol: float
    passed: bool
    versions: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)

    def _rows(self) -> list[tuple[str, str]]:
        tol = "exact equality" if self.atol == 0 and self.rtol == 0 else f"atol={self.atol:g}, rtol={self.rtol:g}"
        return [
            ("reference", self.reference),
            ("converted", self.model),
            ("inputs", self.inputs),
            ("dtype / device", f"{self.dtype} / {self.device}"),
            ("attention", self.attention),
            ("max abs diff", f"{self.max_abs_diff:.3g}"),
            ("max rel diff", f"{self.max_rel_diff:.3g}"),
            ("min cosine similarity", f"{self.cosine_min:.9f}"),
            ("top-1 agreement", f"{self.top1_agreement:.1%}"),
            ("top-5 agreement", f"{self.top5_agreement:.1%}"),
            ("bit-exact", "yes" if self.bit_exact else "no"),
            ("tolerance", tol),
            ("result", "PASS" if self.passed else "FAIL"),
            ("versions", ", ".join(f"{k} {v}" for k, v in self.versions.items())),
        ]

    def format_table(self) -> str:
        """The report as an aligned two-column plain-text table."""
        rows = self._rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def to_markdown(self) -> str:
        """The report as a markdown table."""
        lines = ["| check | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in self._rows()]
        return "\n".join(lines)


def versions() -> dict[str, str]:
    """Versions that decide the numbers: this package, timm, torch, Python."""
    import timm

    return {
        "timm-layerscale": __version__,
        "timm": timm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _is_gamma(name: str) -> bool:
    return name.endswith(("gamma", "gamma_1", "gamma_2"))


@torch.no_grad()
def seed_parameters_(model: nn.Module, seed: int = 0, gamma_std: float = 0.1) -> nn.Module:
    """Fill every parameter and float buffer with seeded random values, in place.

    The values make every branch matter: LayerScale gammas ~ N(0, gamma_std) (not
    the 1e-5 init, which hides differences), matrices ~ N(0, 1/fan_in), norm
    weights ~ 1 + N(0, 0.1), biases and embeddings ~ N(0, 0.1). Values depend only
    on ``seed``, each parameter's name and its shape, so two models whose names map
    onto each other (``gamma_1`` / ``ls1.gamma``) can be filled alike through
    :func:`timm_layerscale.to_layerscale` instead.

    Args:
        model: Any module; parameters on any device and floating dtype.
        seed: Seed of the generator.
        gamma_std: Standard deviation of the LayerScale gammas.

    Returns:
        ``model``.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        shape = p.shape
        if _is_gamma(name):
            v = torch.randn(shape, generator=gen) * gamma_std
        elif p.ndim >= 2 and not name.endswith(("pos_embed", "cls_token", "reg_token")):
            fan_in = math.prod(shape[1:])
            v = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        elif name.endswith("weight") and p.ndim == 1:
            v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            v = 0.1 * torch.randn(shape, generator=gen)
        p.copy_(v.to(p.dtype))
    return model


def seeded_inputs(
    num_inputs: int, img_size: int | Sequence[int], seed: int = 0, in_chans: int = 3
) -> torch.Tensor:
    """Seeded N(0, 1) images, the scale of normalised photographs.

    Returns:
        Tensor ``(num_inputs, in_chans, H, W)`` in fp32.
    """
    h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_inputs, in_chans, h, w, generator=gen)


def image_inputs(paths: Iterable[str], model: nn.Module) -> torch.Tensor:
    """Load image files through timm's data config and eval transforms for ``model``.

    Returns:
        Tensor ``(len(paths), 3, H, W)``.
    """
    from PIL import Image
    from timm.data import create_transform, resolve_data_config

    from .errors import CheckpointError

    cfg = resolve_data_config({}, model=model)
    transform = create_transform(**cfg, is_training=False)
    out = []
    for p in paths:
        try:
            with Image.open(p) as im:
                out.append(transform(im.convert("RGB")))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read image {p}: {e}") from None
    return torch.stack(out)


def attention_path(model: nn.Module) -> str:
    """Which attention implementation a model's attention layers take."""
    flags = {bool(m.fused_attn) for m in model.modules() if hasattr(m, "fused_attn")}
    if not flags:
        return "manual (softmax(q k^T) v)"
    if flags == {True}:
        return "fused (scaled_dot_product_attention)"
    if flags == {False}:
        return "manual (softmax(q k^T) v)"
    return "mixed: fused where timm fuses, manual talking-heads"


@torch.no_grad()
def compare_models(
    reference: nn.Module,
    model: nn.Module,
    inputs: torch.Tensor,
    *,
    reference_name: str,
    model_name: str,
    family: str,
    inputs_desc: str,
    batch_size: int = 4,
    atol: float = 0.0,
    rtol: float = 0.0,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    progress: Callable[[Iterable[torch.Tensor]], Iterable[torch.Tensor]] | None = None,
) -> ParityReport:
    """Run both models on the same inputs and measure how far apart the outputs are.

    Both models are put in eval mode; inputs are cast to the reference's dtype and
    moved to its device.

    Args:
        reference: Model computing the released function from the original weights.
        model: The converted model.
        inputs: Images ``(K, C, H, W)``.
        reference_name, model_name, family, inputs_desc: Labels for the report.
        batch_size: Images per forward pass.
        atol, rtol: Tolerances; both 0 asks for bit-exact equality.
        forward: ``forward(model, x) -> output``; defaults to ``model(x)``.
        progress: Wraps the iterable of input batches, for a progress bar
            (:func:`timm_layerscale.progress.verification_passes`); default none.

    Returns:
        The :class:`ParityReport`.
    """
    forward = forward or (lambda m, x: m(x))
    reference.eval()
    model.eval()
    p = next(reference.parameters())
    dtype, device = p.dtype, p.device
    outs_ref, outs = [], []
    for chunk in (progress or iter)(inputs.split(batch_size)):
        x = chunk.to(device=device, dtype=dtype)
        outs_ref.append(forward(reference, x).float().cpu())
        outs.append(forward(model, x).float().cpu())
    a = torch.cat(outs_ref)
    b = torch.cat(outs)
    if a.shape != b.shape:
        raise ValueError(f"output shapes differ: reference {tuple(a.shape)}, converted {tuple(b.shape)}")
    diff = (a - b).abs()
    denom = a.abs()
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / denom.clamp_min(torch.finfo(torch.float32).tiny))
    a2, b2 = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    cos = torch.nn.functional.cosine_similarity(a2.double(), b2.double(), dim=1)
    bit_exact = all(torch.equal(x, y) for x, y in zip(outs_ref, outs))
    k = min(5, a2.shape[1])
    top1 = (a2.argmax(1) == b2.argmax(1)).float().mean().item()
    top5 = float(
        sum(set(x.tolist()) == set(y.tolist()) for x, y in zip(a2.topk(k, 1).indices, b2.topk(k, 1).indices))
    ) / a2.shape[0]
    if atol == 0 and rtol == 0:
        passed = bit_exact
    else:
        passed = bool((diff <= atol + rtol * denom).all())
    attn = attention_path(reference)
    if attention_path(model) != attn:
        attn = f"reference: {attn}; converted: {attention_path(model)}"
    return ParityReport(
        reference=reference_name,
        model=model_name,
        family=family,
        inputs=inputs_desc,
        num_inputs=int(inputs.shape[0]),
        dtype=str(dtype).replace("torch.", ""),
        device=str(device),
        attention=attn,
        max_abs_diff=float(diff.max()) if diff.numel() else 0.0,
        max_rel_diff=float(rel.max()) if rel.numel() else 0.0,
        cosine_min=float(cos.min()),
        top1_agreement=top1,
        top5_agreement=top5,
        bit_exact=bit_exact,
        atol=float(atol),
        rtol=float(rtol),
        passed=passed,
        versions=versions(),
    )
