"""`higgs-stream` command line: one sub-command per job, each implemented beside what it drives.

Sub-commands import their modules lazily so `higgs-stream --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module that owns it, one-line help). Each module exposes add_arguments(parser) and run(args).
COMMANDS: dict[str, tuple[str, str]] = {
    "make-checkpoint": (
        "higgs_stream.engine.checkpoint_writer",
        "write a random-weight checkpoint (talker + codec + tokenizer) in a real on-disk layout",
    ),
    "synth": ("higgs_stream.synth_cli", "offline text -> WAV (and/or codes)"),
    "serve": ("higgs_stream.stream.serve_command", "run the streaming server (WebSocket, HTTP, WebRTC, demo)"),
    "say": ("higgs_stream.clients.client", "stream speech from a running server into a WAV file"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="higgs-stream", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if _wants_arguments_of(name):
            importlib.import_module(module).add_arguments(p)
    return parser


def _wants_arguments_of(name: str) -> bool:
    """Only import the module whose sub-command is being run (or all, for --help of that command)."""
    argv = sys.argv[1:]
    return name in argv[:1]


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args()
    from higgs_stream.engine.errors import HiggsStreamError

    try:
        result = importlib.import_module(args._module).run(args)
    except HiggsStreamError as exc:
        print(f"higgs-stream {args.command}: error [{exc.code}]: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
