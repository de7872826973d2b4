// Command draformats reads what our DRA driver left on a node the way the owners of the formats
// read it: the CDI specs through the CDI library's cache (the registry containerd and CRI-O
// use), which resolves the device names the driver returned to the kubelet and applies their
// edits to an OCI spec; and the device-metadata files through Kubernetes' devicemetadata
// decoder, each object of the stream on its own and the stream as a consumer reads it.
//
// Usage: draformats <cdi-spec-dir> <comma-separated CDI device names> [metadata-file ...]
//
// It prints one JSON object; a spec or file the libraries refuse is reported in it, not fatal.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/dynamic-resource-allocation/api/metadata"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

type cdiResult struct {
	Devices    []string            `json:"devices"`    // every device the cache knows
	SpecErrors map[string][]string `json:"specErrors"` // spec file -> why the library refused it
	Unresolved []string            `json:"unresolved"`
	Error      string              `json:"error,omitempty"`
	Linux      *oci.Linux          `json:"linux,omitempty"` // the OCI spec after the edits
	Mounts     []oci.Mount         `json:"mounts,omitempty"`
	Env        []string            `json:"env,omitempty"`
}

type metadataObject struct {
	APIVersion string                   `json:"apiVersion"`
	Error      string                   `json:"error,omitempty"`
	Invalid    string                   `json:"invalid,omitempty"` // upstream's declarative validation
	Decoded    *metadata.DeviceMetadata `json:"decoded,omitempty"` // converted to the internal type
}

type metadataResult struct {
	Path    string           `json:"path"`
	Objects []metadataObject `json:"objects"` // each object of the stream, in order
	// What a consumer reading the whole stream gets: the first version it can decode.
	ReadAs string                   `json:"readAs,omitempty"`
	Read   *metadata.DeviceMetadata `json:"read,omitempty"`
	Error  string                   `json:"error,omitempty"`
}

func readCDI(dir string, names []string) cdiResult {
	result := cdiResult{SpecErrors: map[string][]string{}, Unresolved: []string{}}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
	if err != nil {
		result.Error = err.Error()
	}
	if cache == nil {
		return result
	}
	for path, errs := range cache.GetErrors() {
		for _, e := range errs {
			result.SpecErrors[path] = append(result.SpecErrors[path], e.Error())
		}
	}
	result.Devices = cache.ListDevices()
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	unresolved, err := cache.InjectDevices(spec, names...)
	if unresolved != nil {
		result.Unresolved = unresolved
	}
	if err != nil {
		result.Error = err.Error()
		return result
	}
	result.Linux, result.Mounts, result.Env = spec.Linux, spec.Mounts, spec.Process.Env
	return result
}

func readMetadata(path string) metadataResult {
	result := metadataResult{Path: path, Objects: []metadataObject{}}
	data, err := os.ReadFile(path)
	if err != nil {
		result.Error = err.Error()
		return result
	}
	stream := json.NewDecoder(bytes.NewReader(data))
	for stream.More() {
		var raw json.RawMessage
		if err := stream.Decode(&raw); err != nil {
			result.Error = fmt.Sprintf("not a JSON stream: %v", err)
			return result
		}
		var object metadataObject
		var head struct {
			APIVersion string `json:"apiVersion"`
		}
		_ = json.Unmarshal(raw, &head)
		object.APIVersion = head.APIVersion
		var decoded metadata.DeviceMetadata
		var invalid error
		if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(bytes.NewReader(raw)), &decoded,
			devicemetadata.DecodeMetadataWithValidationResult(&invalid)); err != nil {
			object.Error = err.Error()
		} else {
			object.Decoded = &decoded
		}
		if invalid != nil {
			object.Invalid = invalid.Error()
		}
		result.Objects = append(result.Objects, object)
	}
	var read metadata.DeviceMetadata
	var gvk schema.GroupVersionKind
	if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(bytes.NewReader(data)), &read,
		devicemetadata.DecodeMetadataStoreGVKResult(&gvk)); err != nil {
		result.Error = err.Error()
	} else {
		result.ReadAs, result.Read = gvk.GroupVersion().String(), &read
	}
	return result
}

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: draformats <cdi-spec-dir> <comma-separated CDI device names> [metadata-file ...]")
		os.Exit(2)
	}
	names := []string{}
	for _, name := range strings.Split(os.Args[2], ",") {
		if name != "" {
			names = append(names, name)
		}
	}
	out := struct {
		CDI      cdiResult        `json:"cdi"`
		Metadata []metadataResult `json:"metadata"`
	}{CDI: readCDI(os.Args[1], names), Metadata: []metadataResult{}}
	for _, path := range os.Args[3:] {
		out.Metadata = append(out.Metadata, readMetadata(path))
	}
	encoder := json.NewEncoder(os.Stdout)
	encoder.SetIndent("", "  ")
	if err := encoder.Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
