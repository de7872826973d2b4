# One image for the operator and the node agent: the `passthrough` command in a virtualenv,
# its dependencies pinned by requirements.lock, and Debian's pci.ids. The chart sets each
# container's command and user (the agent runs as uid 0 to write the host's sysfs).
#
# `make image` builds it with buildah (e2e/image.py); `docker build .` builds the same.

FROM docker.io/library/debian:bookworm-slim AS build
# For a package mirror or a TLS-intercepting proxy: make image passes the host's index and,
# as the secret pip-ca, its CA bundle. Unset, pip uses PyPI. Only this stage sees them.
ARG PIP_INDEX_URL
ARG PIP_CERT
RUN --mount=type=cache,target=/var/cache/apt \
    --mount=type=cache,target=/var/lib/apt/lists \
    apt-get update -q && apt-get install -y -q --no-install-recommends python3-venv ca-certificates
# Wheels only, without resolving: the stage has no compiler, and the lock is the whole
# runtime closure (`pip check` below fails the build when it is not).
COPY requirements.lock /src/
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip-ca \
    python3 -m venv /opt/passthrough && \
    /opt/passthrough/bin/pip install -q --no-deps --only-binary=:all: -r /src/requirements.lock
COPY pyproject.toml README.md /src/
COPY operator /src/operator
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip-ca \
    /opt/passthrough/bin/pip install -q --no-deps /src && \
    /opt/passthrough/bin/pip check && \
    /opt/passthrough/bin/pip uninstall -q -y pip setuptools

FROM docker.io/library/debian:bookworm-slim
# pci.ids: /usr/share/misc/pci.ids, one of the paths passthrough.pci.pciids searches (the
# agent prefers the node's own, under --host-root). The user has a name because Kopf names
# the operator by getpass.getuser(), which fails for a uid without one.
RUN --mount=type=cache,target=/var/cache/apt \
    --mount=type=cache,target=/var/lib/apt/lists \
    apt-get update -q && apt-get install -y -q --no-install-recommends python3 pci.ids && \
    useradd --system --user-group --uid 65532 --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin nonroot
COPY --from=build /opt/passthrough /opt/passthrough
ENV PATH=/opt/passthrough/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The operator's user (the chart's runAsUser and runAsGroup); the agent's pod sets 0.
USER 65532:65532
ENTRYPOINT ["passthrough"]
CMD ["--help"]
