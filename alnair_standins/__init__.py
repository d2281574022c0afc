"""Stand-ins for the outside world the agent talks to, speaking the real protocols, for the demo, the tests and the
benchmarks. Nothing here is the agent: the agent imports this package only where it is told to simulate (the
simulated GPU backend, ALNAIR_GPU_BACKEND=simulated, and `alnair-agent demo`).

| module | stands in for |
| --- | --- |
| `kubelet.py` | kubelet's device plugin side (Registration, ListAndWatch, Allocate) and its pod-resources API |
| `kubelet_dra.py` | kubelet's DRA side (plugin-watcher registration, NodePrepare/Unprepare) and the runtime's CDI |
| `podresources.py` | kubelet's pod-resources API alone, with a list the test sets |
| `apiserver.py`, `apiserver_resource.py` | the Kubernetes API server (core v1; resource.k8s.io/v1), real JSON |
| `apiserver_process.py` | the same API server in a process of its own |
| `dra_allocator.py` | kube-scheduler's DRA allocator (consumable capacity) |
| `cluster.py` | kube-scheduler with the Alnair extender, and a cluster of nodes (agent + kubelet emulator each) |
| `gpu.py`, `simtimeline.py` | the GPU and its driver as the agent sees them: the simulated backend, the driver's timelines |
| `simdriver.py` | the simulated CUDA driver the demo runs under the shim (built into `lib/sim/` by `pip install`) |
| `node.py`, `dra_node.py` | a node: the real agent beside these stand-ins (device plugin; DRA), in-process or a process |
| `crashloop.py` | a kubelet crash loop, for re-registration tests and the benchmark |
| `simbuild.py` | the shim and the simulated driver built from a checkout, for tests and benchmarks |
| `workloads.py` | the GPU tests' and GPU benchmarks' workloads (PyTorch tenants, NVML polled from outside) |

A separate top-level package rather than `alnair_agent/standins/`: the boundary is the import name itself, so a
reader (and tests/test_layout.py) can tell at a glance that no agent module reaches into a stand-in.
"""
