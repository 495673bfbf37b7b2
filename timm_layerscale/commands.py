"""What each subcommand of ``timm-layerscale`` does, its exit status and its error line.

Each command calls one library function and prints its result (a table, or JSON with
``--json``); heavy modules are imported inside the command that needs them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .options import verify_options
from .progress import write_out

if TYPE_CHECKING:
    from .errors import ParityError

__all__ = [
    "COMMANDS",
    "EXIT_OK",
    "EXIT_VERIFICATION_FAILED",
    "EXIT_USER_ERROR",
    "EXIT_INTERNAL_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_READER_LEFT",
    "PROG",
    "cli_message",
    "error",
    "print_json",
    "stoppable",
]

PROG = "timm-layerscale"

EXIT_OK = 0
EXIT_VERIFICATION_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
EXIT_READER_LEFT = 141


#: Advice in library messages is written for Python callers (``pass overwrite=True``,
#: ``leave out to='gamma'``); :func:`cli_message` rewrites it as options (``pass --overwrite``).
_KEYWORD_ADVICE = re.compile(r"\b(pass|leave out|or) (\w+)=(True|'[^']*'|[0-9][0-9.eE+-]*)")
#: Keyword arguments whose option has another name.
_OPTION_NAMES = {"fmt": "format"}


def cli_message(message: str) -> str:
    """A library error message as the command line says it: keyword advice becomes options.

    ``pass overwrite=True`` becomes ``pass --overwrite``; ``pass model='cait_s24_224_ls'``
    becomes ``pass --model cait_s24_224_ls``; ``pass atol=1e-5`` becomes ``pass --atol 1e-5``;
    ``leave out to='gamma'`` becomes ``leave out --to gamma`` (after "pass", "leave out" or "or").
    """

    def option(m: re.Match[str]) -> str:
        verb, value = m.group(1), m.group(3)
        name = _OPTION_NAMES.get(m.group(2), m.group(2)).replace("_", "-")
        if value == "True":
            return f"{verb} --{name}"
        return f"{verb} --{name} {value.strip(chr(39))}"

    return _KEYWORD_ADVICE.sub(option, message)


def error(message: str) -> None:
    """Print ``message`` as the one error line: ``timm-layerscale: error: ...`` on stderr."""
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class _Terminated(BaseException):
    """SIGTERM, raised where the program stands, so that it cleans up as for Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


def stoppable(run: Callable[[], int], say: Callable[[str], object]) -> int:
    """``run()``, ended by Ctrl-C or SIGTERM (``kill``, ``timeout``, a batch scheduler's time limit)
    as by an exception, so that temporaries and partial outputs are removed on the way out; then
    one line through ``say`` and exit status 130 or 143. SIGTERM is left alone where the calling
    program handles it, or off the main thread. When the reader of the output has left
    (:func:`~timm_layerscale.progress.write_out`), it ends without a word, as Unix tools do, with status 141."""
    previous = None
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # signals are only handled in the main thread
        pass
    try:
        return run()
    except KeyboardInterrupt:
        say("interrupted")
        return EXIT_INTERRUPTED
    except _Terminated:
        say("terminated")
        return EXIT_TERMINATED
    except BrokenPipeError:
        return EXIT_READER_LEFT
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def print_json(obj: Any) -> None:
    """Print ``obj`` as indented, standard JSON: NaN and infinities, which JSON has no numbers for,
    as ``null`` (``jq`` and ``JSON.parse`` refuse Python's ``NaN``); other values it cannot encode
    as strings."""
    write_out(json.dumps(_finite(obj), indent=2, default=str, allow_nan=False))


def _parity_failed(e: ParityError, as_json: bool) -> int:
    """A failed verification: its report as a table, or as JSON with the error, on stdout;
    the one error line on stderr."""
    if as_json:
        print_json({"ok": False, "error": cli_message(str(e)), "report": e.report.to_dict()})
    else:
        write_out(e.report.format_table())
    error(cli_message(str(e)))
    return EXIT_VERIFICATION_FAILED


def cmd_convert(a: argparse.Namespace) -> int:
    from .converter import convert_checkpoint
    from .errors import ParityError

    try:
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
    except ParityError as e:
        return _parity_failed(e, a.json)
    if a.json:
        print_json(
            {
                "ok": True,
                "output": str(res.output),
                "model": res.variant.name,
                "family": res.variant.family,
                "source_sha256": res.source_sha256,
                "source_layout": res.source_layout,
                "target_layout": res.target_layout,
                "container": res.container,
                "seconds": round(res.seconds, 3),
                "metadata": res.metadata,
                "report": res.report.to_dict() if res.report else None,
            }
        )
        return EXIT_OK
    target = f"{res.target_layout} layout" + ("" if res.container == "plain" else f", official file {res.container}")
    target += ", LayerScale folded into the weights" if res.metadata.get("folded_layerscale") == "true" else ""
    write_out(
        f"converted {res.source} ({res.source_layout} layout) -> {res.output} ({target}) "
        f"as {res.variant.name} in {res.seconds:.1f} s"
    )
    if res.report is not None:
        write_out(res.report.format_table())
    return EXIT_OK


def cmd_verify(a: argparse.Namespace) -> int:
    from .converter import verify_checkpoint

    rep = verify_checkpoint(a.source, a.converted, model=a.model, ema=a.ema, options=verify_options(a))
    if a.json:
        print_json({"ok": rep.passed, **rep.to_dict()})
    else:
        write_out(rep.format_table())
    return EXIT_OK if rep.passed else EXIT_VERIFICATION_FAILED


def cmd_list(a: argparse.Namespace) -> int:
    from .catalog import format_catalog, model_catalog

    rows = model_catalog(flops=a.flops)
    if a.json:
        print_json(rows)
    else:
        write_out(format_catalog(rows, flops=a.flops))
    return EXIT_OK


def cmd_demo(a: argparse.Namespace) -> int:
    from .demo import run_demo

    if run_demo(a.out, overwrite=a.overwrite, options=verify_options(a)):
        return EXIT_OK
    error("the demo's parity check failed; see the report above")
    return EXIT_VERIFICATION_FAILED


def cmd_export(a: argparse.Namespace) -> int:
    from .errors import ParityError
    from .hub.export import export_folder

    try:
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
    except ParityError as e:
        return _parity_failed(e, a.json)
    if a.json:
        print_json({"ok": True, **res.to_dict()})
    else:
        write_out(res.summary())
    return EXIT_OK


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
    if a.json:
        print_json({"ok": True, **res.to_dict()})
    else:
        write_out(res.summary())
    return EXIT_OK


def cmd_inspect(a: argparse.Namespace) -> int:
    from pathlib import Path

    from .files.atomic import check_output, file_path
    from .files.sources import public_source
    from .inspection import format_gate_table, gate_profile, plot_format, plot_gates

    if a.plot:  # before any output or download
        plot_format(a.plot)
        check_output(file_path(a.plot), a.overwrite)
    profile = gate_profile(a.source, model=a.model, ema=a.ema)
    if a.json:
        print_json(profile)
    else:
        write_out(format_gate_table(profile))
    if a.plot:
        name = Path(public_source(a.source)).name  # a URL's query can hold credentials
        plot_gates(profile, a.plot, title=f"{name}: LayerScale gates", overwrite=a.overwrite)
        if not a.json:
            write_out(f"plot written to {a.plot}")
    return EXIT_OK


#: Subcommand name to the function that runs it.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "convert": cmd_convert,
    "verify": cmd_verify,
    "list": cmd_list,
    "demo": cmd_demo,
    "export": cmd_export,
    "push": cmd_push,
    "inspect": cmd_inspect,
}
