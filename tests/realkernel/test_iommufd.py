"""iommufd on the real kernels: neither bookworm's 6.1 nor its 6.12 has CONFIG_IOMMUFD (no
/dev/iommu, no /dev/vfio/devices/vfio<N>), so the plugin's Allocate must hand over neither
(KubeVirt 1.9.0's IOMMUFD regression was paths that do not exist). The agent's own code judges a
device bound in the guest: `Handover._cdev` (what the plugin serves) and `allocate_response`.
The real Allocate over the plugin socket on 6.1 is in test_health.py.
"""

from __future__ import annotations

import pytest

from e2e.guest.kernel import SERIES
from e2e.guest.machine import address

TESTDEV = address("testdev")

_ALLOCATE = """
import os
from pathlib import Path
from passthrough.agent.handover import Handover
from passthrough.deviceplugin.allocation import PluginDevice, allocate_response
from passthrough.pci import vfio
sysfs, dev, address = Path('/sys'), Path('/dev'), args['address']
group = int(os.path.basename(os.readlink(f'/sys/bus/pci/devices/{address}/iommu_group')))
vfio.bind_group(sysfs, dev, group, [address])
try:
    handover = Handover(sysfs, dev, plugin_dir=Path('/run/iommufd-check'), state_dir=None)
    cdev = handover._cdev(address)
    answer = allocate_response('passthrough.io/check', [address], {address: PluginDevice(address, group, cdev=cdev)})
    result = {
        'group': group,
        'cdev': cdev,
        'paths': sorted(d.host_path for d in answer.devices),
        'dev_iommu': os.path.exists('/dev/iommu'),
        'vfio_dev_dir': os.path.exists(f'/sys/bus/pci/devices/{address}/vfio-dev'),
        'dev_vfio_devices': os.path.exists('/dev/vfio/devices'),
    }
finally:
    vfio.release_group(sysfs, dev, group, [address])
"""


@pytest.mark.parametrize("series", list(SERIES))
def test_allocate_hands_over_no_iommufd_paths_where_the_kernel_has_none(request, guests, series):
    guest = guests.get(request, series)
    found = guest.python(_ALLOCATE, address=TESTDEV, timeout=240)
    print(f"\n{guest.kernel.package}: {found}")
    # Both kernels list the device under sysfs' vfio-dev/ (vfio0), but make no character device of it:
    # a plugin that went by sysfs alone would hand over /dev/vfio/devices/vfio0, which is not there.
    assert found["vfio_dev_dir"], found
    assert not found["dev_iommu"] and not found["dev_vfio_devices"], (
        f"{guest.kernel.package} has iommufd after all: test the positive case here", found)  # fmt: skip
    assert found["cdev"] == ""
    assert found["paths"] == sorted(["/dev/vfio/vfio", f"/dev/vfio/{found['group']}"])
