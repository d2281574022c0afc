"""Stand-ins for what the agent talks to, speaking the real protocols: the Kubernetes API (apiserver.py) and
kubelet's pod-resources gRPC API (podresources.py); util.py has `running` and `wait_until` for service tests.

Import them as `from fakes.apiserver import FakeApiServer, make_pod` (pytest puts tests/ on sys.path because
tests/ is not a package)."""
