"""A real Kubernetes control plane for the tests: etcd, kube-apiserver and kube-controller-manager on
loopback, a kubelet stand-in for fake nodes, pods in network namespaces, and the shipped manifests
applied and run as deployed."""
