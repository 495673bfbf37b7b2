"""Options shared by the commands that verify, and the command line that reproduces a run.

Standard library only: ``--help`` and argument errors never import torch or timm.
"""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = [
    "OneLineParser",
    "whole_number",
    "tolerance",
    "seed",
    "add_verify_args",
    "check_inputs",
    "verify_options",
    "command_line",
    "published_options",
]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``NAME: error: MESSAGE (see 'PROG --help')``, exit status 2.

    Subclasses set ``name``, the program every error line starts with (a subcommand's too).
    """

    name: str

    def error(self, message: str) -> NoReturn:
        """Exit with status 2 after one line on stderr: ``NAME: error: MESSAGE (see 'PROG --help')``."""
        self.exit(2, f"{self.name}: error: {message} (see '{self.prog} --help')\n")


def whole_number(minimum: int) -> Callable[[str], int]:
    """argparse type: a whole number >= ``minimum`` (a batch size, a number of inputs)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def tolerance(text: str) -> float:
    """argparse type: a finite number >= 0 (an absolute or relative tolerance)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def seed(text: str) -> int:
    """argparse type: a seed ``torch.manual_seed`` takes, from -2**63 to 2**64 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be from -2**63 to 2**64 - 1 (the seeds torch takes), got {value}")
    return value


def add_verify_args(p: argparse.ArgumentParser) -> None:
    """The verification options, the same for every command that verifies."""
    g = p.add_argument_group("verification")
    g.add_argument("--exact", action="store_true", help="demand bit-exact outputs (torch.equal), whatever the family")
    g.add_argument(
        "--atol",
        type=tolerance,
        metavar="X",
        help="absolute tolerance (default: the family's rule; 0 = bit-exact for CaiT and DeiT-III)",
    )
    g.add_argument("--rtol", type=tolerance, metavar="X", help="relative tolerance (default: the family's rule)")
    g.add_argument(
        "--num-inputs",
        type=whole_number(0),
        default=8,
        metavar="K",
        help="seeded random images (default 8; 0 with --images)",
    )
    g.add_argument("--seed", type=seed, default=0, help="seed of the random images (default 0)")
    g.add_argument("--images", nargs="+", default=[], metavar="FILE", help="image files added to the inputs")
    g.add_argument("--device", default="cpu", help="run both models on cpu (default) or cuda")
    g.add_argument(
        "--batch-size", type=whole_number(1), default=4, metavar="N", help="images per forward pass (default 4)"
    )


def check_inputs(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Exit with ``p``'s argument error when :func:`add_verify_args` options leave no inputs."""
    if a.num_inputs == 0 and not a.images:
        p.error("argument --num-inputs: 0 leaves no inputs; pass --images FILE ... too")


def verify_options(a: argparse.Namespace) -> Any:
    """The :class:`~timm_layerscale.parity.tolerance.VerifyOptions` of parsed :func:`add_verify_args` options."""
    from .parity.tolerance import VerifyOptions

    return VerifyOptions(
        atol=a.atol,
        rtol=a.rtol,
        exact=a.exact,
        num_inputs=a.num_inputs,
        seed=a.seed,
        images=tuple(a.images),
        device=a.device,
        batch_size=a.batch_size,
    )


def command_line(words: Sequence[Any], options: Any = None, **opts: Any) -> str:
    """A command line: ``words`` as given, then ``opts`` and the non-default ``options`` as flags.

    A flag's value ``True`` gives a bare flag; ``None``, ``False`` and empty sequences leave
    it out (a zero is a value: ``--atol 0``).
    """
    parts = [str(w) for w in words]
    if options is not None:
        opts.update(verify_flags(options))
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is not None and value is not False and value not in ((), []):
            parts += [flag] + ([str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)])
    return shlex.join(parts)


def published_options(options: Any) -> Any:
    """``options`` (:class:`~timm_layerscale.parity.tolerance.VerifyOptions` or ``None``) with its
    image files by their names, as a published model card's command line gives local paths."""
    from dataclasses import replace

    from .files.sources import published_path

    return options and replace(options, images=tuple(map(published_path, options.images)))


def verify_flags(options: Any) -> dict[str, Any]:
    """The non-default :class:`~timm_layerscale.parity.tolerance.VerifyOptions` as ``{flag_name: value}``."""
    from .parity.tolerance import VerifyOptions

    default = VerifyOptions()
    flags: dict[str, Any] = {}
    for name in ("exact", "atol", "rtol", "num_inputs", "seed", "images", "device", "batch_size"):
        value = getattr(options, name)
        if value != getattr(default, name):
            flags[name] = list(value) if name == "images" else value
    return flags
