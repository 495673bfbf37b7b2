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
141   the reader of the output left before it was written (``| head``); nothing is said
143   terminated (SIGTERM: ``kill``, ``timeout``, a batch scheduler's time limit)
====  ==========================================================================

Interrupted or terminated, a command removes its temporaries and partial outputs on
the way out.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable, Sequence

from ._version import __version__
from .commands import (
    COMMANDS,
    EXIT_INTERNAL_ERROR,
    EXIT_USER_ERROR,
    PROG,
    cli_message,
    error,
    print_json,
    stoppable,
)
from .options import OneLineParser, add_verify_args, check_inputs
from .progress import write_out

__all__ = ["main", "build_parser"]

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


class _Parser(OneLineParser):
    name = PROG


def _add_common(p: argparse.ArgumentParser, top: bool = False, quiet: bool = True) -> None:
    # Subcommands must not reset a --debug or --quiet given before them.
    default = False if top else argparse.SUPPRESS
    p.add_argument("--debug", action="store_true", default=default, help="show the full traceback on errors")
    if quiet:
        p.add_argument(
            "-q",
            "--quiet",
            action="store_true",
            default=default,
            help="no progress bars (they are shown only when stderr is a terminal)",
        )


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
    parser.set_defaults(subcommands=sub.choices)  # for an error that names the subcommand's --help

    def add(name: str, help: str, epilog: str = "", quiet: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, help=help, description=help, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        _add_common(p, quiet=quiet)
        return p

    def source_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", metavar="NAME", help="model name; overrides architecture detection")
        p.add_argument(
            "--ema",
            action="store_true",
            help="take the EMA weights of a training checkpoint ('model_ema', or timm's 'state_dict_ema')",
        )

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
        "--to",
        choices=("ls", "gamma"),
        default="ls",
        help="target layout (default: ls). gamma writes the official file: a .pth holding "
        "{'model': {'module.' + key: tensor}} for CaiT, {'model': state_dict} for DeiT-III and ViT-5",
    )
    p.add_argument(
        "--plain", action="store_true", help="with --to gamma: write the bare state dict, without the official wrapper"
    )
    p.add_argument(
        "--format",
        dest="fmt",
        choices=("safetensors", "pth"),
        help="output format (default: from OUTPUT's suffix: .safetensors, or .pth .pt .bin .ckpt)",
    )
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="cast floating tensors (default: keep)")
    p.add_argument("--fold", action="store_true", help="fold LayerScale into the preceding Linear layers")
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
    p.add_argument(
        "--repo-id",
        metavar="ORG/NAME",
        help="repo id shown in the model card's usage code (default: --push-to-hub, else ORG/<DIR name> "
        "where that is a valid id, else ORG/NAME)",
    )
    p.add_argument(
        "--to",
        choices=("ls", "gamma"),
        default="ls",
        help="ls (default): this package's architecture (cait_*_ls, vit5_*). gamma, for CaiT: timm's own "
        "cait_* architecture and gamma_1 layout, which timm and transformers load without this package",
    )
    p.add_argument(
        "--label-names",
        metavar="FILE",
        help="class names of a fine-tuned head: one per line (name<TAB>description allowed), a JSON list "
        "or a JSON object from class index to name, as id2label (default: a source folder's or Hub "
        "repository's, else timm's ImageNet names for 1000 classes, none otherwise)",
    )
    p.add_argument(
        "--tag",
        help="pretrained tag written into config.json (default: a source folder's or Hub repository's, "
        "else the architecture's, e.g. fb_dist_in1k)",
    )
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
    p.add_argument(
        "--plot", metavar="FILE.png", help="draw the gate profile: .png, .svg, .pdf (needs timm-layerscale[plot])"
    )
    p.add_argument("--overwrite", action="store_true", help="replace the --plot file if it exists")
    p.add_argument("--json", action="store_true", help="print as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Exit status: 0 ok, 1 verification failed, 2 user error, 3 internal error
    (130 when interrupted, 141 when the reader of the output has left, 143 when terminated).
    Every error is one line on stderr starting with ``timm-layerscale: error:``.
    """
    if isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.errors == "strict":
        sys.stdout.reconfigure(errors="backslashreplace")  # a name in bytes of no encoding: shown as stderr shows it
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as e:  # after --help or --version, whose text may still wait in stdout's buffer
        code = int(e.code or 0)

        def flushed() -> int:
            write_out("", end="")
            return code

        raise SystemExit(_run(flushed, debug=False)) from None
    if extra:  # said by the subcommand's parser, so the advice is its --help
        args.subcommands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not args.command:
        parser.print_help(sys.stderr)
        return EXIT_USER_ERROR
    if hasattr(args, "num_inputs"):
        check_inputs(args.subcommands[args.command], args)
    if getattr(args, "quiet", False):
        from .progress import disable_progress_bars

        disable_progress_bars()
    return _run(lambda: COMMANDS[args.command](args), args.debug, getattr(args, "json", False))


def _run(command: Callable[[], int], debug: bool, as_json: bool = False) -> int:
    """``command()``'s exit status, or that of the error it raised, said in one line (raised with
    ``debug``); with ``as_json``, also as ``{"ok": false, "error": ...}`` on stdout, as a failed check is."""

    def say(message: str) -> None:
        if as_json:
            print_json({"ok": False, "error": " ".join(message.split())})
        error(message)

    try:
        return stoppable(command, say)
    except Exception as e:
        from .errors import LayerScaleError

        if debug:
            raise
        if isinstance(e, LayerScaleError):
            say(cli_message(str(e)))
            return getattr(e, "exit_code", EXIT_USER_ERROR)
        if isinstance(e, OSError) and e.filename is not None:
            # The file system refused a path the user chose (permissions, a full disk, /proc).
            say(f"{e.filename}: {e.strerror or type(e).__name__}; check the path and its permissions")
            return EXIT_USER_ERROR
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e):
            # Python's, a CUDA device's (torch.OutOfMemoryError) or torch's CPU allocator's
            say("out of memory; free memory, or verify with a smaller --batch-size or --num-inputs")
            return EXIT_USER_ERROR
        say(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback and report it)")
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
