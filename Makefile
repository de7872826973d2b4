# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
# Everything else here is a step they use, or a convenience.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
# Tests run in a private mount namespace of their own: the simulated kernel (e2e/fakekernel.py)
# mounts FUSE files over its fixture trees there, and nothing of it reaches the host's mounts.
TESTNS := unshare --mount --propagation private

.PHONY: run test unit integration crds protos controlplane cluster-up cluster-down bench chaos image venv clean

venv: $(STAMP) libfuse

## libfuse3 for the simulated kernel's FUSE filesystem: Debian's libfuse3-3 when the loader lacks it.
.PHONY: libfuse
libfuse:
	@$(PYTHON) -c "import ctypes.util, sys; sys.exit(not ctypes.util.find_library('fuse3'))" || { \
		echo "installing libfuse3-3 (apt-get)"; \
		apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600 libfuse3-3 \
		|| { apt-get update -q -o DPkg::Lock::Timeout=600 \
		     && apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600 libfuse3-3; }; }

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,docs]'
	@rm -f $(VENV)/.installed-*
	@touch $@

## The control-plane binaries, and KubeVirt's (its CRD generator, virt-api, virt-controller and
## virt-operator's webhooks: e2e/virt.py), built once, cached outside the tree.
controlplane: venv
	$(PY) -m e2e.build
	$(PY) -m e2e.virt

## The main job: local control plane, CRDs, operator, KubeVirt's virt-api and virt-controller
## and simulated nodes; a VirtualMachine naming a device gets its launcher pod. Ctrl-C stops all.
## `make run DRA=1`: in DRA mode (the agents publish ResourceSlices, pods take devices through claims).
## `make run REALNODE=1`: a real node instead (containerd, runc, CNI, kube-proxy) with the chart helm-installed on it.
run: controlplane
	$(TESTNS) $(PY) -m e2e.devcluster $(if $(filter-out 0,$(DRA)),--dra) $(if $(filter-out 0,$(REALNODE)),--real-node)

## The real-kernel rig (e2e/guest): Debian's qemu-system-x86 and busybox-static when missing, and
## the 6.1 and 6.12 kernels unpacked into the cache, and runc (e2e/oci.py) that runs the chart's
## containers in the guest. Where that fails the real-kernel tests skip, saying why; under CI=true
## it fails.
.PHONY: realkernel
realkernel: venv
	$(PY) -m e2e.guest.kernel
	$(PY) -m e2e.oci

## Every test: unit tests, tests against the real control plane and on a real kernel.
## What they run is made first, three at a time: the Go programs one after another (each build
## takes both cores) beside the real-kernel rig and the image, which mostly download and unpack,
## so a first run waits for the longest of them, not their sum.
test: venv
	$(MAKE) --no-print-directory -j3 programs realkernel testimage
	$(TESTNS) $(PY) -m pytest -q

## The Go programs the tests run: the control plane's and KubeVirt's, then the real node's.
.PHONY: programs
programs: controlplane
	$(PY) -m e2e.realnode.build

## The image the real-node tests install the chart from (e2e/image.py), as they would build it.
## Where it cannot be built here, its tests say why (and fail under CI=true): not this step.
.PHONY: testimage
testimage: venv
	-$(PY) -m e2e.image --keep-lock

unit: venv
	$(TESTNS) $(PY) -m pytest -q tests/unit

integration: controlplane
	$(TESTNS) $(PY) -m pytest -q tests/integration

## Regenerate crds/, the chart's CRDs and its values.schema.json from the API models.
crds: venv
	$(VENV)/bin/passthrough crds --out crds
	$(VENV)/bin/passthrough crds --out charts/passthrough-operator/crds
	$(VENV)/bin/passthrough values-schema --out charts/passthrough-operator/values.schema.json

## The documentation site (docs/, mkdocs.yml) at http://127.0.0.1:8000, rebuilt on every change.
## `make test` builds it with --strict (tests/unit/test_docs_site.py).
.PHONY: docs docs-generate
docs: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

## Regenerate the site's generated pages (troubleshooting, the reference) from the code.
docs-generate: venv
	$(PY) docs/generate.py

## Regenerate the kubelet gRPC code (deviceplugin/kubeletapi and dra/kubeletapi under operator/passthrough) from its vendored protos.
protos: venv
	$(PY) -m passthrough.deviceplugin.kubeletapi.codegen

cluster-up: controlplane
	$(PY) -m e2e.cluster up

cluster-down: venv
	$(PY) -m e2e.cluster down

## Every benchmark script, the control plane's first; each prints its figures.
bench: controlplane
	@set -e; for script in e2e/bench/bench_controlplane.py $$(ls e2e/bench/bench_*.py | grep -v bench_controlplane); do \
		echo "== $$script"; $(TESTNS) $(PY) $$script; done

## The fault suite: every fault kind, many seeded trials (e2e/chaos.py); prints invariant
## violations, time to converge and process exits. Pass flags with CHAOS_ARGS="--seed 42".
chaos: controlplane
	$(TESTNS) $(PY) e2e/chaos.py $(CHAOS_ARGS)

## The container image, passthrough-operator:<the chart's appVersion> (e2e/image.py): buildah
## and mmdebstrap from Debian's packages when missing, requirements.lock rewritten from .venv.
image: venv
	$(PY) -m e2e.image

clean: cluster-down
	rm -rf $(VENV) .cluster .devcluster
