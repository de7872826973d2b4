"""`passthrough render`: the KubeVirt configuration (or Cozystack Package) for a values file."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from passthrough.kubevirt.render import cozystack_package, render as render_values
from passthrough.kubevirt.values import ValuesError, parse_values

EXIT_INVALID = 2
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def dump(document: Any, output: str) -> str:
    """The text `render` prints: YAML in the key order of the templates, or indented JSON."""
    if output == "json":
        return json.dumps(document, indent=2) + "\n"
    return yaml.dump(document, Dumper=_DUMPER, sort_keys=False, default_flow_style=False, width=1000)


def _fail(path: str, problems: list[str]) -> int:
    print(f"passthrough render: {path}: invalid values:", file=sys.stderr)
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)
    return EXIT_INVALID


_TOO_DEEP = "nested deeper than any values file needs (the settings are four levels deep); check for a runaway paste or anchor"


def render(args: argparse.Namespace) -> int:
    try:
        with open(args.values, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        return _fail(args.values, [f"cannot read it: {e.strerror or e}"])
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        return _fail(args.values, [f"not valid YAML: {e}"])
    except RecursionError:
        return _fail(args.values, [_TOO_DEEP])
    try:
        rendered = render_values(parse_values(data))
    except ValuesError as e:
        return _fail(args.values, e.problems)
    except RecursionError:
        return _fail(args.values, [_TOO_DEEP])

    for warning in rendered.warnings:
        print(f"passthrough render: warning: {warning}", file=sys.stderr)
    document = cozystack_package(rendered) if args.format == "cozystack-package" else rendered.patch
    sys.stdout.write(dump(document, args.output))
    return 0
