// Command fakeruntime is a stand-in CRI container runtime for tests that run the real kubelet.
//
// It serves Kubernetes' own fake runtime (k8s.io/cri-client/pkg/fake, backed by
// k8s.io/cri-api/pkg/apis/testing) on a unix socket, and appends every CreateContainer
// request to a JSON-lines file: that is how a test sees what the kubelet handed the runtime
// (the envs, devices and mounts a device plugin's Allocate answered with). Nothing runs:
// containers only change state in memory.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
)

// recorder wraps the fake runtime; every method but CreateContainer is the fake's own.
type recorder struct {
	*fake.RemoteRuntime
	mu  sync.Mutex
	out *os.File
}

type device struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Permissions   string `json:"permissions"`
}

type mount struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Readonly      bool   `json:"readonly"`
}

type record struct {
	Time         string            `json:"time"`
	PodSandboxID string            `json:"pod_sandbox_id"`
	Container    string            `json:"container"`
	Pod          string            `json:"pod"`
	Namespace    string            `json:"namespace"`
	PodUID       string            `json:"pod_uid"`
	Image        string            `json:"image"`
	Envs         map[string]string `json:"envs"`
	Devices      []device          `json:"devices"`
	CDIDevices   []string          `json:"cdi_devices"`
	Mounts       []mount           `json:"mounts"`
	Annotations  map[string]string `json:"annotations"`
}

func (r *recorder) CreateContainer(ctx context.Context, req *runtimeapi.CreateContainerRequest) (*runtimeapi.CreateContainerResponse, error) {
	rec := record{
		Time:         time.Now().UTC().Format(time.RFC3339Nano),
		PodSandboxID: req.GetPodSandboxId(),
		Envs:         map[string]string{},
		Devices:      []device{},
		CDIDevices:   []string{},
		Mounts:       []mount{},
		Annotations:  map[string]string{},
	}
	cfg := req.GetConfig()
	rec.Container = cfg.GetMetadata().GetName()
	rec.Image = cfg.GetImage().GetImage()
	if meta := req.GetSandboxConfig().GetMetadata(); meta != nil {
		rec.Pod, rec.Namespace, rec.PodUID = meta.GetName(), meta.GetNamespace(), meta.GetUid()
	}
	for _, kv := range cfg.GetEnvs() {
		rec.Envs[kv.GetKey()] = string(kv.GetValue()) // bytes in cri-api v0.37
	}
	for _, d := range cfg.GetDevices() {
		rec.Devices = append(rec.Devices, device{d.GetContainerPath(), d.GetHostPath(), d.GetPermissions()})
	}
	for _, d := range cfg.GetCDIDevices() {
		rec.CDIDevices = append(rec.CDIDevices, d.GetName())
	}
	for _, m := range cfg.GetMounts() {
		rec.Mounts = append(rec.Mounts, mount{m.GetContainerPath(), m.GetHostPath(), m.GetReadonly()})
	}
	for k, v := range cfg.GetAnnotations() {
		rec.Annotations[k] = v
	}
	line, err := json.Marshal(rec)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	_, err = r.out.Write(append(line, '\n'))
	r.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("recording CreateContainer: %w", err)
	}
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	r.setLogPath(resp.GetContainerId(), req)
	return resp, nil
}

// setLogPath reports the container's log file where a real runtime would put it, and makes it.
// The fake leaves LogPath empty, and when the kubelet removes a container it deletes
// glob("<LogPath>*"): with an empty path, every file in its working directory.
func (r *recorder) setLogPath(id string, req *runtimeapi.CreateContainerRequest) {
	dir, name := req.GetSandboxConfig().GetLogDirectory(), req.GetConfig().GetLogPath()
	if dir == "" || name == "" {
		return
	}
	path := filepath.Join(dir, name)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err == nil {
		if f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640); err == nil {
			_ = f.Close()
		}
	}
	r.RuntimeService.Lock()
	defer r.RuntimeService.Unlock()
	if c, ok := r.RuntimeService.Containers[id]; ok {
		c.LogPath = path
	}
}

func main() {
	socket := flag.String("socket", "", "unix socket path to serve CRI on")
	record := flag.String("record", "", "file to append one JSON line per CreateContainer request to")
	imageSize := flag.Uint64("image-size", 64<<20, "size reported for every (fake) image, in bytes")
	flag.Parse()
	if *socket == "" || *record == "" {
		fmt.Fprintln(os.Stderr, "usage: fakeruntime --socket=PATH --record=FILE")
		os.Exit(2)
	}
	out, err := os.OpenFile(*record, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}

	rt := fake.NewFakeRemoteRuntime()
	rt.RuntimeService.FakeStatus = &runtimeapi.RuntimeStatus{
		Conditions: []*runtimeapi.RuntimeCondition{
			{Type: runtimeapi.RuntimeReady, Status: true},
			{Type: runtimeapi.NetworkReady, Status: true},
		},
	}
	rt.RuntimeService.FakeLinuxConfiguration = &runtimeapi.LinuxRuntimeConfiguration{
		CgroupDriver: runtimeapi.CgroupDriver_CGROUPFS,
	}
	// Without a size the kubelet refuses to start containers ("Id or size of image ... is not set").
	rt.ImageService.SetFakeImageSize(*imageSize)
	fsUsage := func() []*runtimeapi.FilesystemUsage {
		return []*runtimeapi.FilesystemUsage{{
			Timestamp:  time.Now().UnixNano(),
			FsId:       &runtimeapi.FilesystemIdentifier{Mountpoint: filepath.Dir(*socket)},
			UsedBytes:  &runtimeapi.UInt64Value{Value: *imageSize},
			InodesUsed: &runtimeapi.UInt64Value{Value: 1},
		}}
	}
	rt.ImageService.FakeFilesystemUsage = fsUsage()
	rt.ImageService.FakeContainerFilesystemUsage = fsUsage()

	server := grpc.NewServer()
	rec := &recorder{RemoteRuntime: rt, out: out}
	runtimeapi.RegisterRuntimeServiceServer(server, rec)
	runtimeapi.RegisterImageServiceServer(server, rec)

	path := strings.TrimPrefix(*socket, "unix://")
	_ = os.Remove(path)
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	listener, err := net.Listen("unix", path)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		server.Stop()
	}()
	fmt.Fprintf(os.Stderr, "fakeruntime serving CRI on %s, recording to %s\n", path, *record)
	if err := server.Serve(listener); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	_ = os.Remove(path)
}
