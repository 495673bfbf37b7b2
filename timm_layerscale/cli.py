"""The command line, ``timm-layerscale`` (also ``python -m timm_layerscale``): each subcommand calls one
library function and prints its result (``--json`` for JSON). Nothing heavy is imported before a
subcommand runs, so ``--help`` and argument errors are instant.

Exit status: 0 success; 1 verification failed; 2 user error (bad arguments or input, an existing
output, a network or Hub failure); 3 internal error; 130 interrupted; 141 the reader of the output
left (``| head``), said quietly. Every error is one line starting with ``timm-layerscale: error:``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ._version import __version__
from .errors import COMMAND_LINE
from .families import LAYOUT_NAMES
from .options import OneLineParser, add_verify_args, check_inputs, verify_options
from .progress import write_out

__all__ = ["build_parser", "main"]

PROG = "timm-layerscale"
EXAMPLES = """\
exit status: 0 ok, 1 verification failed, 2 user error, 3 internal error.

examples:
  timm-layerscale demo                                  # offline end-to-end run
  timm-layerscale convert S24_224.pth cait_s24_224_ls.safetensors
  timm-layerscale convert hf-hub:timm/cait_s24_224.fb_dist_in1k s24_ls.safetensors --dtype bf16
  timm-layerscale verify S24_224.pth cait_s24_224_ls.safetensors --images cat.jpg
  timm-layerscale export S24_224.pth hub/cait_s24_224_ls.fb_dist_in1k
  timm-layerscale push hub/cait_s24_224_ls.fb_dist_in1k ORG/cait_s24_224_ls.fb_dist_in1k --dry-run
  timm-layerscale inspect S24_224.pth --plot gates.png
  timm-layerscale list --flops
"""


class _Parser(OneLineParser):
    name = PROG


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (imports nothing heavy)."""
    parser = _Parser(
        prog=PROG,
        description="LayerScale models for timm: convert checkpoints between layouts (ls, timm, official, "
        "transformers), verify output parity, export to the Hugging Face Hub.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def common(p: argparse.ArgumentParser, default: Any) -> None:  # a subcommand keeps what was given before it
        p.add_argument("--debug", action="store_true", default=default, help="show the full traceback on errors")
        p.add_argument("-q", "--quiet", action="store_true", default=default, help="no progress bars")

    common(parser, False)

    def add(name: str, help: str, *args: str, source: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(parser=p)
        common(p, argparse.SUPPRESS)
        for arg in args:
            p.add_argument(arg, metavar=arg.upper())
        if source:
            p.add_argument("--model", metavar="NAME", help="model name; overrides architecture detection")
            p.add_argument("--ema", action="store_true", help="take the EMA weights of a training checkpoint")
        if name not in ("demo",):
            p.add_argument("--json", action="store_true", help="print the result as JSON")
        return p

    p = add("convert", "convert a checkpoint between layouts and verify parity", "source", "output", source=True)
    _convert_args(p)

    p = add("verify", "compare the reference on SOURCE with the model on CONVERTED", "source", "converted", source=True)
    add_verify_args(p)

    p = add("list", "list the registered models, their references and pretrained tags")
    p.add_argument("--flops", action="store_true", help="add multiply counts of one forward pass")

    p = add("demo", "offline end to end: write an official-layout checkpoint, convert, verify, export, reload")
    p.add_argument("--out", default="demo-out", metavar="DIR", help="output folder (default: demo-out)")
    p.add_argument("--overwrite", action="store_true", help="replace earlier demo output")
    add_verify_args(p)

    p = add(
        "export",
        "convert, verify and write a Hub-ready folder (weights, config.json, card)",
        "source",
        "dir",
        source=True,
    )
    _export_args(p)

    p = add(
        "push",
        "upload an exported folder to the Hugging Face Hub (token from 'hf auth login' or HF_TOKEN)",
        "dir",
        "repo_id",
    )
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--revision", metavar="R", help="branch to commit to")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    p.add_argument("--commit-message", metavar="M", help="commit message")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded; make no request")

    p = add(
        "inspect",
        "show the LayerScale gates of a checkpoint, block by block, and what converting it to each layout would do",
        "source",
        source=True,
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw the gate profile: .png, .svg, .pdf (needs matplotlib)")
    p.add_argument("--overwrite", action="store_true", help="replace the --plot file if it exists")
    return parser


def _convert_args(p: argparse.ArgumentParser) -> None:
    """The options of ``convert``."""
    p.add_argument(
        "--to",
        choices=LAYOUT_NAMES,
        default="ls",
        help="target layout, where the family has it: ls (default; this package's modules), timm (the state dict of "
        "timm's own model), official (the authors' release file), transformers (what AutoModel loads); gamma: a word "
        "of one release, the official .pth (DINOv3: timm's layout), else timm's",
    )
    p.add_argument("--plain", action="store_true", help="deprecated: --to gamma without the container; use --to timm")
    p.add_argument("--format", dest="fmt", choices=("safetensors", "pth"), help="default: from OUTPUT's suffix")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="cast floating tensors (default: keep)")
    p.add_argument("--fold", action="store_true", help="fold LayerScale into the preceding Linear layers")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the parity check")
    p.add_argument("--allow-nonfinite", action="store_true", help="convert even if tensors hold NaN/Inf")
    add_verify_args(p)


def _export_args(p: argparse.ArgumentParser) -> None:
    """The options of ``export``."""
    p.add_argument("--overwrite", action="store_true", help="write into DIR although it holds files, removing them")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the folder after exporting it")
    p.add_argument(
        "--repo-id", metavar="ORG/NAME", help="repo id in the card's usage code (default --push-to-hub or ORG/<DIR>)"
    )
    p.add_argument(
        "--to",
        choices=LAYOUT_NAMES,
        default="ls",
        help="ls (default): this package's architecture; timm: timm's own (CaiT, DINOv3); transformers: a folder its "
        "AutoModel loads (DINOv2, DINOv3); gamma: timm's",
    )
    p.add_argument("--label-names", metavar="FILE", help="class names of a fine-tuned head: one per line, or JSON")
    p.add_argument("--tag", help="pretrained tag in config.json (default: the source's, else the architecture's)")
    p.add_argument("--private", action="store_true", help="create the Hub repository as private")
    p.add_argument("--commit-message", metavar="M", help="commit message of the upload")
    add_verify_args(p)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def print_json(obj: Any) -> None:
    """``obj`` as standard JSON: NaN and infinities, which JSON has no numbers for, as ``null``."""
    write_out(json.dumps(_finite(obj), indent=2, default=str, allow_nan=False))


def _show(a: argparse.Namespace, fields: dict[str, Any], text: str) -> int:
    print_json({"ok": True, **fields}) if a.json else write_out(text)
    return 0


def cmd_convert(a: argparse.Namespace) -> int:
    from .converter import convert_checkpoint

    res = convert_checkpoint(
        a.source,
        a.output,
        model=a.model,
        to=a.to,
        fmt=a.fmt,
        dtype=a.dtype,
        overwrite=a.overwrite,
        verify=a.verify,
        allow_nonfinite=a.allow_nonfinite,
        ema=a.ema,
        fold=a.fold,
        plain=a.plain,
        options=verify_options(a),
    )
    fields = {
        "output": str(res.output),
        "model": res.variant.name,
        "family": res.variant.family.name,
        "source_sha256": res.source_sha256,
        "source_layout": res.source_layout,
        "target_layout": res.target_layout,
        "container": res.container,
        "note": res.note or None,
        "seconds": round(res.seconds, 3),
        "phases": res.phases,
        "metadata": res.metadata,
        "report": res.report.to_dict() if res.report else None,
    }
    if res.note and not a.json:
        _say("note", res.note)
    target = f"{res.target_layout} layout" + ("" if res.container == "state dict" else f", {res.container}")
    target += ", LayerScale folded into the weights" if a.fold else ""
    text = f"converted {res.source} ({res.source_layout} layout) -> {res.output} ({target}) as {res.variant.name} in {res.seconds:.1f} s"
    return _show(a, fields, text + (f"\n{res.report.format_table()}" if res.report else ""))


def cmd_verify(a: argparse.Namespace) -> int:
    from .converter import verify_checkpoint

    rep = verify_checkpoint(a.source, a.converted, model=a.model, ema=a.ema, options=verify_options(a))
    print_json({"ok": rep.passed, **rep.to_dict()}) if a.json else write_out(rep.format_table())
    return 0 if rep.passed else 1


def cmd_list(a: argparse.Namespace) -> int:
    from .catalog import format_catalog, model_catalog

    rows = model_catalog(flops=a.flops)
    print_json(rows) if a.json else write_out(format_catalog(rows, flops=a.flops))
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from .demo import run_demo

    if run_demo(a.out, overwrite=a.overwrite, options=verify_options(a)):
        return 0
    _error("the demo's parity check failed; see the report above")
    return 1


def cmd_export(a: argparse.Namespace) -> int:
    from .hub.export import export_folder

    res = export_folder(
        a.source,
        a.dir,
        model=a.model,
        overwrite=a.overwrite,
        ema=a.ema,
        options=verify_options(a),
        push_to_hub=a.push_to_hub,
        private=a.private,
        commit_message=a.commit_message,
        repo_id=a.repo_id,
        to=a.to,
        label_names=a.label_names,
        tag=a.tag,
    )
    return _show(a, res.to_dict(), res.summary())


def cmd_push(a: argparse.Namespace) -> int:
    from .hub.upload import push_folder

    res = push_folder(
        a.dir,
        a.repo_id,
        private=a.private,
        revision=a.revision,
        create_pr=a.create_pr,
        commit_message=a.commit_message,
        dry_run=a.dry_run,
    )
    return _show(a, res.to_dict(), res.summary())


def cmd_inspect(a: argparse.Namespace) -> int:
    from pathlib import Path

    from .files.atomic import output_path
    from .files.read import public_source
    from .inspection import format_gate_table, format_plan, inspect_checkpoint, plot_format, plot_gates

    if a.plot:  # before any output or download
        plot_format(a.plot)
        output_path(a.plot, a.overwrite)
    seen = inspect_checkpoint(a.source, model=a.model, ema=a.ema)
    print_json(seen) if a.json else write_out(f"{format_gate_table(seen['gates'])}\n\n{format_plan(seen)}")
    if a.plot:
        name = Path(public_source(a.source)).name  # a URL's query can hold credentials
        plot_gates(seen["gates"], a.plot, title=f"{name}: LayerScale gates", overwrite=a.overwrite)
        if not a.json:
            write_out(f"plot written to {a.plot}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "convert": cmd_convert,
    "verify": cmd_verify,
    "list": cmd_list,
    "demo": cmd_demo,
    "export": cmd_export,
    "push": cmd_push,
    "inspect": cmd_inspect,
}


def _say(kind: str, message: str) -> None:
    print(f"{PROG}: {kind}: {' '.join(message.split())}", file=sys.stderr)


def _error(message: str) -> None:
    _say("error", message)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status where parsing ended the command (``--help``, ``--version``)."""
    try:
        return parser.parse_args(argv)
    except SystemExit:  # after --help or --version, whose text may still wait in stdout's buffer
        from .errors import LayerScaleError

        try:
            write_out("", end="")
        except BrokenPipeError:
            return 141
        except LayerScaleError as e:  # a full device
            _error(str(e))
            return 2
        raise


def _failed(e: Exception, as_json: bool) -> int:
    """The one line (and a failed check's report) for an exception of a command, and its exit status."""
    from .errors import LayerScaleError, ParityError

    def say(message: str) -> None:
        if as_json:
            print_json({"ok": False, "error": " ".join(message.split())})
        _error(message)

    if isinstance(e, ParityError):  # its report on stdout, as a passing check's
        one = " ".join(str(e).split())
        if as_json:
            print_json({"ok": False, "error": one, "report": e.report.to_dict()})
        else:
            write_out(e.report.format_table())
        _error(one)
        return 1
    if isinstance(e, LayerScaleError):
        say(str(e))
        return e.exit_code
    if isinstance(e, OSError) and e.filename is not None:  # the file system refused a path the user chose
        say(f"{e.filename}: {e.strerror or type(e).__name__}; check the path and its permissions")
        return 2
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e):
        say("out of memory; free memory, or verify with a smaller --batch-size or --num-inputs")
        return 2
    say(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback and report it)")
    return 3


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    if isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.errors == "strict":
        sys.stdout.reconfigure(errors="backslashreplace")  # a name in bytes of no encoding, as stderr shows it
    parser = build_parser()
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    if not args.command:
        parser.print_help(sys.stderr)
        return 2
    if hasattr(args, "num_inputs"):
        check_inputs(args.parser, args)
    if getattr(args, "quiet", False):
        from .progress import disable_progress_bars

        disable_progress_bars()
    as_json = getattr(args, "json", False)
    token = COMMAND_LINE.set(True)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        if as_json:
            print_json({"ok": False, "error": "interrupted"})
        _error("interrupted")
        return 130
    except BrokenPipeError:  # the reader left: end quietly, as Unix tools do
        return 141
    except Exception as e:
        if args.debug:
            raise
        return _failed(e, as_json)
    finally:
        COMMAND_LINE.reset(token)


if __name__ == "__main__":
    sys.exit(main())
