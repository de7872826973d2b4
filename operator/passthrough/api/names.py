"""The API's names and bounds as plain constants, without pydantic.

The agent (and the API client under it) needs the group, the version, the kind it writes and the
bounds of what it writes, and nothing else of `models`: importing pydantic and building the models
would cost it about 11 MiB of its memory. `models` builds the schema from these same values.
"""

from __future__ import annotations

GROUP = "passthrough.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# A DNS-1123 label, the shape of a namespace name.
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
PCI_VENDOR_SELECTOR = r"^[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}$"
PCI_ADDRESS = r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$"
HEX4 = r"^[0-9a-f]{4}$"
HEX6 = r"^[0-9a-f]{6}$"
CAMEL_CASE_REASON = r"^[A-Z][A-Za-z0-9]*$"

CONFIG_NAME = "cluster"

# Bounds of every string and list the API server stores (a writer may not store objects of
# any size), generous for real data. Names as Kubernetes bounds them:
DNS1123_LABEL_MAX = 63  # a namespace
DNS1123_SUBDOMAIN_MAX = 253  # a node, a VM, a KubeVirt CR
QUALIFIED_NAME_MAX = 317  # an extended resource name: a DNS-1123 subdomain, "/", a 63-character name
UID_MAX = 128  # a uid (36 characters today)
TIMESTAMP_MAX = 64  # RFC 3339
# pci.ids names are at most 119 characters (the 2025 edition); a kernel driver's is a file name.
PCI_IDS_NAME_MAX = 1024
DRIVER_MAX = 255
# metav1.Condition's own bounds.
CONDITION_TYPE_MAX, CONDITION_REASON_MAX, MESSAGE_MAX = 316, 1024, 32768
MAX_CONDITIONS = 16
# The operator's lists of mismatches hold their first 50 (controller/kubevirt_sync.py MAX_LISTED).
MAX_LISTED_ITEMS = 100
# An allow-list of thousands of entries renders in milliseconds; 5,000 of them fit an object.
MAX_ALLOW_LIST = 5000
MAX_FEATURE_GATES = 64
FEATURE_GATE_MAX = 128
# A device is held by one pod, or for a moment by the pods of its old and new resource; more
# than this many at once is a kubelet's stale record, and the first of them are enough to act on.
MAX_HOLDERS = 16

NODE_PCI_DEVICE_KIND, NODE_PCI_DEVICE_PLURAL = "NodePCIDevice", "nodepcidevices"
