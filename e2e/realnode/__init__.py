"""A real node: the project's kubelet with containerd 2.x, runc, the CNI bridge and kube-proxy,
and its own control plane, in network, mount and PID namespaces the harness makes and removes.

- `build`: containerd, the CNI plugins, pause and kube-proxy built from the Go module proxy, cached;
- `node`: `RealNode`, the caller's side (start, stop, kubectl, helm, what the host still has);
- `inside`: the node's supervisor, PID 1 of its namespaces;
- `config`: its addresses and the configuration of its programs;
- `images`: the pause image and the project's image as archives containerd imports;
- `install`: the chart installed on it as the README says; `run`: `make run REALNODE=1`.
"""
