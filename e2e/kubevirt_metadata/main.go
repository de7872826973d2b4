// Command kubevirtmetadata runs KubeVirt's own virt-launcher code, unmodified, on a directory of
// KEP-5304 device-metadata files: it prints, as JSON, the libvirt host devices virt-launcher
// would put in the domain of a VMI whose GPUs and host devices name DRA claims. The tests
// (tests/integration/test_kubevirt_metadata.py) point it at files our DRA driver wrote, so
// what KubeVirt reads from them is KubeVirt's answer, not ours.
//
// Usage: kubevirtmetadata <metadata base dir> <vmi.json>
// The base dir stands for /var/run/kubernetes.io/dra-device-attributes in the launcher pod.
package main

import (
	"encoding/json"
	"encoding/xml"
	"fmt"
	"os"

	v1 "kubevirt.io/api/core/v1"

	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/api"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/device/hostdevice/dra"
)

// hostDevice is what a test compares: the alias KubeVirt gives the device and its PCI address.
type hostDevice struct {
	Alias   string `json:"alias"`
	Type    string `json:"type"`
	Managed string `json:"managed"`
	Address string `json:"address"`
	XML     string `json:"xml"` // the <hostdev> element as libvirt receives it
}

// result is one of virt-launcher's two DRA entry points: the devices it made, or its error.
type result struct {
	HostDevices []hostDevice `json:"hostDevices"`
	Error       string       `json:"error,omitempty"`
}

func convert(devices []api.HostDevice, err error) result {
	out := result{HostDevices: []hostDevice{}}
	if err != nil {
		out.Error = err.Error()
		return out
	}
	for _, d := range devices {
		entry := hostDevice{Type: d.Type, Managed: d.Managed}
		if d.Alias != nil {
			entry.Alias = d.Alias.GetName()
		}
		if a := d.Source.Address; a != nil {
			entry.Address = fmt.Sprintf("%s:%s:%s.%s", trimHex(a.Domain), trimHex(a.Bus), trimHex(a.Slot), trimHex(a.Function))
		}
		text, err := xml.Marshal(d)
		if err != nil {
			out.Error = err.Error()
			return out
		}
		entry.XML = string(text)
		out.HostDevices = append(out.HostDevices, entry)
	}
	return out
}

// trimHex turns libvirt's "0x0000" into "0000".
func trimHex(s string) string {
	if len(s) > 2 && s[:2] == "0x" {
		return s[2:]
	}
	return s
}

func run(args []string) error {
	if len(args) != 2 {
		return fmt.Errorf("usage: kubevirtmetadata <metadata base dir> <vmi.json>")
	}
	raw, err := os.ReadFile(args[1])
	if err != nil {
		return err
	}
	var vmi v1.VirtualMachineInstance
	if err := json.Unmarshal(raw, &vmi); err != nil {
		return fmt.Errorf("%s: not a VirtualMachineInstance: %w", args[1], err)
	}
	gpus := convert(dra.CreateDRAGPUHostDevices(&vmi, args[0]))
	hostDevices := convert(dra.CreateDRAHostDevices(&vmi, args[0]))
	return json.NewEncoder(os.Stdout).Encode(map[string]result{"gpus": gpus, "hostDevices": hostDevices})
}

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(2)
	}
}
