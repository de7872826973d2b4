"""What the agent and the operator load: no kubernetes_asyncio (32 MiB of models), and no gRPC
in an agent that serves no device plugins. Each check runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

OPERATOR_DIR = Path(__file__).resolve().parents[2] / "operator"


def modules(code: str) -> set[str]:
    """Every module `code` leaves loaded, by its full name."""
    probe = code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(OPERATOR_DIR), "PATH": "/usr/bin:/bin"})  # fmt: skip
    return set(out.stdout.split())


def loaded(code: str) -> set[str]:
    """The top-level packages `code` leaves loaded."""
    return {m.split(".")[0] for m in modules(code)}


def test_the_agent_loads_neither_kubernetes_asyncio_nor_grpc():
    modules = loaded("import passthrough.agent.main, passthrough.agent.loop")
    assert "aiohttp" in modules and "passthrough" in modules
    assert "kubernetes_asyncio" not in modules and "grpc" not in modules
    # The schema's models are the operator's: the agent builds plain dicts (about 11 MiB less).
    assert "pydantic" not in modules


def test_the_agent_imports_no_controller_code(tmp_path):
    agent = modules(
        "import passthrough.agent.main, passthrough.agent.loop\n"
        "from passthrough.agent.handover import Handover\n"
        f"Handover(sysfs_root={str(tmp_path)!r}, plugin_dir={str(tmp_path)!r})"
    )
    assert "passthrough.agent.loop" in agent and "passthrough.deviceplugin.server" in agent
    assert not {m for m in agent if m == "passthrough.controller" or m.startswith("passthrough.controller.")}


def test_an_agent_that_serves_device_plugins_loads_grpc_when_it_starts_them(tmp_path):
    modules = loaded(f"from passthrough.agent.handover import Handover\nHandover(sysfs_root={str(tmp_path)!r}, plugin_dir={str(tmp_path)!r})")
    assert "grpc" in modules and "kubernetes_asyncio" not in modules and "pydantic" not in modules


def test_the_operator_starts_kopf_and_its_handlers_without_kubernetes_asyncio():
    modules = loaded(
        "from passthrough.controller import main\n"
        "main.load_kopf()\n"
        "from passthrough.controller import handlers\n"
        "from passthrough.admission import webhook\n"
    )
    assert "kopf" in modules and "kubernetes_asyncio" not in modules


def test_the_command_line_loads_pydantic_only_for_the_commands_that_need_it():
    # `passthrough agent` starts from here: the parser and the agent's modules, no schema.
    modules = loaded("from passthrough import cli\ncli.build_parser()\nimport passthrough.agent.main")
    assert "passthrough" in modules and "pydantic" not in modules and "yaml" not in modules


def test_the_values_schema_help_names_the_charts_file():
    from passthrough import cli
    from passthrough.api.chart_values import VALUES_SCHEMA

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command" or getattr(a, "choices", None) and "values-schema" in a.choices)
    out = next(a for a in sub.choices["values-schema"]._actions if a.dest == "out")
    assert str(VALUES_SCHEMA) in out.help
