"""Entry point: runs the CLI and maps every failure to the one exit-code table (httpie's split:
``main`` handles errors, the commands in ``eepctl.cli`` hold none)."""

from __future__ import annotations

import os
import signal
import sys

import typer

from engine_ext.protocol import EepError, ExitCode


def _err(msg: str) -> None:
    sys.stderr.write(f"eepctl: {msg}\n")


def main(argv: list[str] | None = None) -> None:
    try:
        code = run(argv)
    except SystemExit as e:  # shell completion leaves through click's SystemExit
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    # Done: a signal now would only turn a finished command's status into 130 (or a silent death
    # by SIGINT, past Python's own handling); the process ends in a moment anyway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "ray" in sys.modules:
        # A Ray driver's atexit shutdown costs about half a second and has nothing to clean
        # up for us (every actor eepctl creates is detached): leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def run(argv: list[str] | None = None) -> int:
    stdout = sys.stdout
    try:
        return _run(argv)
    finally:  # an in-process caller gets its stdout back (connecting diverts it: eepctl.streams)
        sys.stdout = stdout


def _interrupted() -> int:
    """SIGINT or SIGTERM ended the command: one line (what it was doing, what it leaves running)."""
    from eepctl import interrupt

    line, code = interrupt.outcome()
    _err(line)
    return code


def _run(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or "--traceback" in args or bool(os.environ.get("EEPCTL_DEBUG"))
    from eepctl import interrupt, streams
    from eepctl.cli import app
    from eepctl.completion import install_completion_classes

    install_completion_classes()
    streams.own_stdout()
    interrupt.reset()
    interrupt.install()
    try:
        rv = app(args=args, prog_name="eepctl", standalone_mode=False)
        code = int(rv) if isinstance(rv, int) else int(ExitCode.OK)
        if interrupt.received or code == ExitCode.INTERRUPTED:  # typer returns 130 for a KeyboardInterrupt
            return _interrupted()
        return code
    except typer.Exit as e:
        return int(e.exit_code)
    except typer.Abort:
        return _interrupted()
    except typer.TyperException as e:  # bad usage (typer's click): one line, exit 2
        if debug:
            raise
        ctx = getattr(e, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        _err(e.format_message().replace("\n", " ") + where)
        return int(getattr(e, "exit_code", ExitCode.USAGE) or ExitCode.USAGE)
    except EepError as e:
        if debug:
            raise
        _err(e.message)
        return int(e.exit_code)
    except KeyboardInterrupt:
        return _interrupted()
    except Exception as e:  # noqa: BLE001 - the one place unexpected errors become exit 1
        if debug:
            raise
        _err(f"unexpected error: {type(e).__name__}: {e} (rerun with --debug for the traceback)")
        return int(ExitCode.ERROR)
