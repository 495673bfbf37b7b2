"""The verification options of every command that verifies, and the command line that reproduces a run.
Standard library only: ``--help`` and argument errors never import torch."""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = ["OneLineParser", "add_verify_args", "check_inputs", "command_line", "published_options", "verify_options"]

_FIELDS = ("exact", "atol", "rtol", "num_inputs", "seed", "images", "device", "batch_size", "stream")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``NAME: error: MESSAGE (see 'PROG --help')``, exit status 2."""

    name: str

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.name}: error: {message} (see '{self.prog} --help')\n")


def _number(kind: Callable[[str], Any], low: float, what: str, high: float = math.inf) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` within ``[low, high)``, finite."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (low <= value < high and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def add_verify_args(p: argparse.ArgumentParser) -> None:
    """The verification options, the same for every command that verifies."""
    g = p.add_argument_group("verification")
    g.add_argument("--exact", action="store_true", help="demand bit-exact outputs (torch.equal), whatever the family")
    tolerance = _number(float, 0, "a number >= 0")
    g.add_argument("--atol", type=tolerance, metavar="X", help="absolute tolerance (default: the family's rule)")
    g.add_argument("--rtol", type=tolerance, metavar="X", help="relative tolerance (default: the family's rule)")
    count = _number(int, 0, "a whole number >= 0")
    g.add_argument("--num-inputs", type=count, default=8, metavar="K", help="seeded random images (default 8)")
    seed = _number(int, -(2**63), "a seed from -2**63 to 2**64 - 1", 2**64)
    g.add_argument("--seed", type=seed, default=0, help="seed of the random images (default 0)")
    g.add_argument("--images", nargs="+", default=[], metavar="FILE", help="image files added to the inputs")
    g.add_argument("--device", default="cpu", help="run both models on cpu (default) or cuda")
    size = _number(int, 1, "a whole number >= 1")
    g.add_argument("--batch-size", type=size, default=4, metavar="N", help="images per forward pass (default 4)")
    g.add_argument(
        "--stream",
        action="store_const",
        const=True,
        help="read each block's weights from the files as it runs (default: where two fp32 models would fill more "
        "than half the available memory)",
    )


def check_inputs(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Exit with ``p``'s argument error when the options leave no inputs."""
    if a.num_inputs == 0 and not a.images:
        p.error("argument --num-inputs: 0 leaves no inputs; pass --images FILE ... too")


def verify_options(a: argparse.Namespace) -> Any:
    """The :class:`~timm_layerscale.parity.tolerance.VerifyOptions` of parsed :func:`add_verify_args` options."""
    from .parity.tolerance import VerifyOptions

    return VerifyOptions(**{name: getattr(a, name) for name in _FIELDS})


def published_options(options: Any) -> Any:
    """``options`` with its image files by their names, as a published card gives local paths."""
    from dataclasses import replace

    from .files.read import published_path

    return options and replace(options, images=tuple(map(published_path, options.images)))


def command_line(words: Sequence[Any], options: Any = None, **opts: Any) -> str:
    """``words``, then ``opts`` and the non-default fields of ``options`` (VerifyOptions) as flags: ``True``
    a bare flag; ``None``, ``False`` and empty sequences left out."""
    parts = [str(w) for w in words]
    if options is not None:
        from .parity.tolerance import VerifyOptions

        default = VerifyOptions()
        opts.update({k: getattr(options, k) for k in _FIELDS if getattr(options, k) != getattr(default, k)})
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is not None and value is not False and value not in ((), []):
            parts += [flag, *map(str, value if isinstance(value, (list, tuple)) else [value])]
    return shlex.join(parts)
