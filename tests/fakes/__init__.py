"""Stand-ins for what the agent talks to, speaking the real protocols: the Kubernetes API (apiserver.py) and
kubelet's pod-resources gRPC API (podresources.py)."""
