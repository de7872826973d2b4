"""The `passthrough` command: one entry point for the operator, the node agent and the tools."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from passthrough.api import crds

# Exit codes: 0 ok, 1 a runtime failure (cluster unreachable, ...), 2 bad usage or input.
EXIT_USAGE = 2


def _not_implemented(name: str) -> Callable[[argparse.Namespace], int]:
    def run(_: argparse.Namespace) -> int:
        print(f"passthrough {name}: not implemented yet", file=sys.stderr)
        return EXIT_USAGE

    return run


def _cmd_crds(args: argparse.Namespace) -> int:
    if args.out:
        for path in crds.write_crds(Path(args.out)):
            print(path)
        return 0
    sys.stdout.write("---\n".join(crds.render_yaml(c) for c in crds.all_crds()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="passthrough",
        description="PCI and GPU passthrough for KubeVirt virtual machines.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("operator", help="run the operator (Kopf)")
    p.set_defaults(func=_not_implemented("operator"))

    p = sub.add_parser("agent", help="run the node agent")
    p.set_defaults(func=_not_implemented("agent"))

    p = sub.add_parser("discover", help="print what the agent would report on this host")
    p.set_defaults(func=_not_implemented("discover"))

    p = sub.add_parser("render", help="print the KubeVirt configuration for a values file")
    p.set_defaults(func=_not_implemented("render"))

    p = sub.add_parser("resource-name", help="print the resource name of VENDOR:DEVICE IDs")
    p.set_defaults(func=_not_implemented("resource-name"))

    p = sub.add_parser("crds", help="print the CustomResourceDefinitions (or write them to --out)")
    p.add_argument("--out", metavar="DIR", help="write one manifest per CRD into DIR")
    p.set_defaults(func=_cmd_crds)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
