"""`passthrough crds` and `passthrough values-schema`: the manifests the API models make.

Their own room, so that the CLI (and with it the agent) loads pydantic only for them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from passthrough.api import chart_values, crds as crd_manifests


def crds(args: argparse.Namespace) -> int:
    if args.out:
        for path in crd_manifests.write_crds(Path(args.out)):
            print(path)
        return 0
    sys.stdout.write("---\n".join(crd_manifests.render_yaml(c) for c in crd_manifests.all_crds()))
    return 0


def values_schema(args: argparse.Namespace) -> int:
    if args.out:
        print(chart_values.write_values_schema(Path(args.out)))
        return 0
    sys.stdout.write(chart_values.render(chart_values.values_schema()))
    return 0
