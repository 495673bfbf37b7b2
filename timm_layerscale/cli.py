"""Command line: ``timm-layerscale`` (also ``python -m timm_layerscale``).

A thin argparse front end: each subcommand parses its arguments and calls one
library function. Nothing heavy is imported until a subcommand runs, so ``--help``
and argument errors are instant. Every error is one line on stderr starting with
``timm-layerscale: error:``; ``--debug`` shows the traceback. Exit status, for
every command:

====  ==========================================================================
0     success
1     verification failed: the converted model does not match its reference
2     user error: bad arguments, unreadable or unsuitable input, existing output,
      network or Hub failure (the message says what to do)
3     internal error: a bug; rerun with ``--debug`` and report the traceback
130   interrupted (Ctrl-C)
====  ==========================================================================
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ._version import __version__

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_VERIFICATION_FAILED", "EXIT_USER_ERROR", "EXIT_INTERNAL_ERROR"]

PROG = "timm-layerscale"

EXIT_OK = 0
EXIT_VERIFICATION_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 3
EXIT_INTERRUPTED = 130

EXAMPLES = """\
exit status: 0 ok, 1 verification failed, 2 user error, 3 internal error.

examples:
  timm-layerscale demo                                  # offline end-to-end run
  timm-layerscale convert S24_224.pth cait_s24_224_ls.safetensors
  timm-layerscale convert https://dl.fbaipublicfiles.com/deit/XXS24_224.pth xxs24.safetensors
  timm-layerscale convert hf-hub:timm/cait_s24_224.fb_dist_in1k s24_ls.safetensors --dtype bf16
  timm-layerscale verify S24_224.pth cait_s24_224_ls.safetensors --images cat.jpg
  timm-layerscale export S24_224.pth hub/cait_s24_224_ls.fb_dist_in1k
  timm-layerscale push hub/cait_s24_224_ls.fb_dist_in1k ORG/cait_s24_224_ls.fb_dist_in1k --dry-run
  timm-layerscale inspect S24_224.pth --plot gates.png
  timm-layerscale list --flops
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, the prefix of every error
        self.exit(EXIT_USER_ERROR, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a count of inputs or a batch size)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def tolerance(text: str) -> float:
    """argparse type: a finite number >= 0 (an absolute or relative tolerance)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _add_common(p: argparse.ArgumentParser, top: bool = False, quiet: bool = True) -> None:
    # Subcommands must not reset a --debug or --quiet given before them.
    default = False if top else argparse.SUPPRESS
    p.add_argument("--debug", action="store_true", default=default, help="show the full traceback on errors")
    if quiet:
        p.add_argument(
            "-q", "--quiet", action="store_true", default=default,
            help="no progress bars (they are shown only when stderr is a terminal)",
        )


def add_verify_args(p: argparse.ArgumentParser) -> None:
    """The verification options, the same for every command that verifies."""
    g = p.add_argument_group("verification")
    g.add_argument("--exact", action="store_true", help="demand bit-exact outputs (torch.equal), whatever the family")
    g.add_argument("--atol", type=tolerance, metavar="X",
                   help="absolute tolerance (default: the family's rule; 0 = bit-exact for CaiT and DeiT-III)")
    g.add_argument("--rtol", type=tolerance, metavar="X", help="relative tolerance (default: the family's rule)")
    g.add_argument("--num-inputs", type=positive_int, default=8, metavar="K", help="seeded random images (default 8)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random images (default 0)")
    g.add_argument("--images", nargs="+", default=[], metavar="FILE", help="image files added to the inputs")
    g.add_argument("--device", default="cpu", help="run both models on cpu (default) or cuda")
    g.add_argument("--batch-size", type=positive_int, default=4, metavar="N", help="images per forward pass (default 4)")


def verify_options(a: argparse.Namespace) -> Any:
    """The :class:`~timm_layerscale.parity.tolerance.VerifyOptions` of parsed :func:`add_verify_args` options."""
    from .parity.tolerance import VerifyOptions

    return VerifyOptions(
        atol=a.atol, rtol=a.rtol, exact=a.exact, num_inputs=a.num_inputs, seed=a.seed, images=tuple(a.images),
        device=a.device, batch_size=a.batch_size,
    )


def command_line(words: Sequence[Any], options: Any = None, **opts: Any) -> str:
    """A command line: ``words`` as given, then ``opts`` and the non-default ``options`` as flags.

    A flag's value ``True`` gives a bare flag; ``None``, ``False`` and empty values leave it out.
    """
    parts = [str(w) for w in words]
    if options is not None:
        opts.update(verify_flags(options))
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value not in (None, False, (), []):
            parts += [flag] + ([str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)])
    return shlex.join(parts)


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (imports nothing heavy)."""
    parser = _Parser(
        prog=PROG,
        description="LayerScale models for timm: convert checkpoints between the gamma_1/gamma_2 "
        "and ls1.gamma layouts, verify output parity, export to the Hugging Face Hub.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name: str, help: str, epilog: str = "", quiet: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_common(p, quiet=quiet)
        return p

    def source_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", metavar="NAME", help="model name; overrides architecture detection")
        p.add_argument("--ema", action="store_true", help="take the EMA weights of a training checkpoint ('model_ema', or timm's 'state_dict_ema')")

    p = add(
        "convert",
        "convert a checkpoint between layouts and verify parity",
        "SOURCE is a local file, an https:// URL or hf-hub:ORG/REPO[/FILE].\n"
        "example: timm-layerscale convert XXS24_224.pth cait_xxs24_224_ls.safetensors",
    )
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("output", metavar="OUTPUT")
    source_args(p)
    p.add_argument(
        "--to", choices=("ls", "gamma"), default="ls",
        help="target layout (default: ls). gamma writes the official file: a .pth holding "
        "{'model': {'module.' + key: tensor}} for CaiT, {'model': state_dict} for DeiT-III and ViT-5",
    )
    p.add_argument("--plain", action="store_true", help="with --to gamma: write the bare state dict, without the official wrapper")
    p.add_argument("--format", dest="fmt", choices=("safetensors", "pth"), help="output format (default: from OUTPUT's suffix, else safetensors)")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="cast floating tensors (default: keep)")
    p.add_argument("--fuse", action="store_true", help="fold LayerScale into the preceding Linear layers")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the parity check")
    p.add_argument("--allow-nonfinite", action="store_true", help="convert even if tensors hold NaN/Inf")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_verify_args(p)

    p = add(
        "verify",
        "compare the reference model on SOURCE with the model loaded from CONVERTED",
        "exit status: 0 parity holds, 1 it does not, 2 bad input.\n"
        "example: timm-layerscale verify XXS24_224.pth cait_xxs24_224_ls.safetensors",
    )
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("converted", metavar="CONVERTED")
    source_args(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_verify_args(p)

    p = add("list", "list the registered models, their references and pretrained tags", quiet=False)
    p.add_argument("--flops", action="store_true", help="add multiply counts of one forward pass")
    p.add_argument("--json", action="store_true", help="print as JSON")

    p = add("demo", "offline end to end: write an official-layout checkpoint, convert, verify, export, reload")
    p.add_argument("--out", default="demo-out", metavar="DIR", help="output folder (default: demo-out)")
    p.add_argument("--overwrite", action="store_true", help="replace earlier demo output")
    add_verify_args(p)

    p = add(
        "export",
        "convert, verify and write a Hub-ready folder (weights, config.json, model card)",
        "example: timm-layerscale export S24_224.pth hub/cait_s24_224_ls.fb_dist_in1k --push-to-hub ORG/cait_s24_224_ls.fb_dist_in1k",
    )
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("dir", metavar="DIR")
    source_args(p)
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the folder after exporting it")
    p.add_argument("--repo-id", metavar="ORG/NAME", help="repo id shown in the model card's usage code (default: --push-to-hub, else ORG/<DIR name>)")
    p.add_argument("--private", action="store_true", help="create the Hub repository as private")
    p.add_argument("--commit-message", metavar="M", help="commit message of the upload")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_verify_args(p)

    p = add(
        "push",
        "upload an exported folder to the Hugging Face Hub",
        "the token comes from 'hf auth login' or HF_TOKEN and is never printed.\n"
        "example: timm-layerscale push hub/cait_s24_224_ls.fb_dist_in1k ORG/cait_s24_224_ls.fb_dist_in1k --dry-run",
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument("repo_id", metavar="REPO_ID")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--revision", metavar="R", help="branch to commit to")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    p.add_argument("--commit-message", metavar="M", help="commit message")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded; make no request")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = add("inspect", "show the LayerScale gates of a checkpoint, block by block")
    p.add_argument("source", metavar="SOURCE")
    source_args(p)
    p.add_argument("--plot", metavar="FILE.png", help="draw the gate profile (needs timm-layerscale[plot])")
    p.add_argument("--json", action="store_true", help="print as JSON")
    return parser


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _cmd_convert(a: argparse.Namespace) -> int:
    from .conversion.pipeline import convert_checkpoint
    from .errors import ParityError

    try:
        res = convert_checkpoint(
            a.source, a.output, model=a.model, to=a.to, fmt=a.fmt, dtype=a.dtype, overwrite=a.overwrite,
            verify=a.verify, allow_nonfinite=a.allow_nonfinite, ema=a.ema, fuse=a.fuse, plain=a.plain,
            options=verify_options(a),
        )
    except ParityError as e:
        if a.json:
            _print_json({"ok": False, "error": cli_message(str(e)), "report": e.report.to_dict()})
        else:
            print(e.report.format_table())
        _error(cli_message(str(e)))
        return EXIT_VERIFICATION_FAILED
    if a.json:
        _print_json({
            "ok": True, "output": str(res.output), "model": res.variant.name, "family": res.variant.family,
            "source_sha256": res.source_sha256, "source_layout": res.source_layout, "target_layout": res.target_layout,
            "container": res.container,
            "seconds": round(res.seconds, 3), "metadata": res.metadata,
            "report": res.report.to_dict() if res.report else None,
        })
        return 0
    target = f"{res.target_layout} layout" + ("" if res.container == "plain" else f", official file {res.container}")
    print(f"converted {res.source} ({res.source_layout} layout) -> {res.output} ({target}) as {res.variant.name} in {res.seconds:.1f} s")
    if res.report is not None:
        print(res.report.format_table())
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    from .conversion.pipeline import verify_checkpoint

    rep = verify_checkpoint(a.source, a.converted, model=a.model, ema=a.ema, options=verify_options(a))
    if a.json:
        _print_json(rep.to_dict())
    else:
        print(rep.format_table())
    return EXIT_OK if rep.passed else EXIT_VERIFICATION_FAILED


def _cmd_list(a: argparse.Namespace) -> int:
    from .catalog import format_catalog, model_catalog

    rows = model_catalog(flops=a.flops)
    if a.json:
        _print_json(rows)
    else:
        print(format_catalog(rows, flops=a.flops))
    return 0


def _cmd_demo(a: argparse.Namespace) -> int:
    from .demo import run_demo

    if run_demo(a.out, overwrite=a.overwrite, options=verify_options(a)):
        return EXIT_OK
    _error("the demo's parity check failed; see the report above")
    return EXIT_VERIFICATION_FAILED


def _cmd_export(a: argparse.Namespace) -> int:
    from .errors import ParityError
    from .hub.export import export_folder

    try:
        res = export_folder(
            a.source, a.dir, model=a.model, overwrite=a.overwrite, ema=a.ema, options=verify_options(a),
            push_to_hub=a.push_to_hub, private=a.private, commit_message=a.commit_message, repo_id=a.repo_id,
        )
    except ParityError as e:
        print(e.report.format_table())
        _error(cli_message(str(e)))
        return EXIT_VERIFICATION_FAILED
    if a.json:
        _print_json(res.to_dict())
    else:
        print(res.summary())
    return 0


def _cmd_push(a: argparse.Namespace) -> int:
    from .hub.upload import push_folder

    res = push_folder(
        a.dir, a.repo_id, private=a.private, revision=a.revision, create_pr=a.create_pr,
        commit_message=a.commit_message, dry_run=a.dry_run,
    )
    if a.json:
        _print_json(res.to_dict())
    else:
        print(res.summary())
    return 0


def _cmd_inspect(a: argparse.Namespace) -> int:
    from .inspection import format_gate_table, gate_profile, plot_gates, require_matplotlib

    if a.plot:
        require_matplotlib()  # before any output or download
    profile = gate_profile(a.source, model=a.model, ema=a.ema)
    if a.json:
        _print_json(profile)
    else:
        print(format_gate_table(profile))
    if a.plot:
        from pathlib import Path

        plot_gates(profile, a.plot, title=f"{Path(a.source).name}: LayerScale gates")
        if not a.json:
            print(f"plot written to {a.plot}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "convert": _cmd_convert,
    "verify": _cmd_verify,
    "list": _cmd_list,
    "demo": _cmd_demo,
    "export": _cmd_export,
    "push": _cmd_push,
    "inspect": _cmd_inspect,
}


#: Advice in library messages is written for Python callers (``pass overwrite=True``);
#: :func:`cli_message` rewrites it as options (``pass --overwrite``).
_KEYWORD_ADVICE = re.compile(r"\bpass (\w+)=(True|'[^']*'|[0-9][0-9.eE+-]*)")
#: Keyword arguments whose option has another name.
_OPTION_NAMES = {"fmt": "format"}


def cli_message(message: str) -> str:
    """A library error message as the command line says it: keyword advice becomes options.

    ``pass overwrite=True`` becomes ``pass --overwrite``; ``pass model='cait_s24_224_ls'``
    becomes ``pass --model cait_s24_224_ls``; ``pass atol=1e-5`` becomes ``pass --atol 1e-5``.
    """

    def option(m: re.Match[str]) -> str:
        name = _OPTION_NAMES.get(m.group(1), m.group(1)).replace("_", "-")
        value = m.group(2)
        if value == "True":
            return f"pass --{name}"
        return f"pass --{name} {value.strip(chr(39))}"

    return _KEYWORD_ADVICE.sub(option, message)


def _error(message: str) -> None:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Exit status: 0 ok, 1 verification failed, 2 user error, 3 internal error
    (130 when interrupted). Every error is one line on stderr starting with
    ``timm-layerscale: error:``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help(sys.stderr)
        return EXIT_USER_ERROR
    if getattr(args, "quiet", False):
        from .progress import disable_progress_bars

        disable_progress_bars()
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        from .errors import LayerScaleError

        if args.debug:
            raise
        if isinstance(e, LayerScaleError):
            _error(cli_message(str(e)))
            return getattr(e, "exit_code", EXIT_USER_ERROR)
        if isinstance(e, OSError) and e.filename is not None:
            # The file system refused a path the user chose (permissions, a full disk, /proc).
            _error(f"{e.filename}: {e.strerror or type(e).__name__}; check the path and its permissions")
            return EXIT_USER_ERROR
        _error(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback and report it)")
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
