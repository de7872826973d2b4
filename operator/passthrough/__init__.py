"""passthrough-operator: PCI and GPU passthrough for KubeVirt virtual machines."""

# The one place the version is written: pyproject.toml reads it from here (setuptools' `attr:`),
# and the CLI, the User-Agent and the build-info metric read it without importlib.metadata,
# which costs each process about 1 MiB (zipfile, csv, email) to read one string.
__version__ = "0.1.0"
