"""Named constants shared across the agent: resource names, device-ID format, annotation keys, paths, env names.

One definition of each fact; every other module imports from here.
"""

from __future__ import annotations

# -- Kubernetes extended resources -------------------------------------------------------------------------
RESOURCE_MEMORY = "alnair/vgpu-memory"  # 1 unit = ALNAIR_MEMORY_UNIT_MIB MiB of one GPU's memory
RESOURCE_COMPUTE = "alnair/vgpu-compute"  # 1 unit = 1 % of one GPU
RESOURCES = (RESOURCE_MEMORY, RESOURCE_COMPUTE)
COMPUTE_UNITS_PER_GPU = 100
# How many GPUs a container's units are spread over, evenly (default 1). Not a device plugin resource: no plugin
# registers it, so kubelet leaves it out of admission (it ignores extended resources its node does not offer), and
# alnair-scheduler's extender manages it (ignoredByScheduler). alnair/vgpu-memory and alnair/vgpu-compute stay the
# container's totals (what kubelet allocates and counts), each GPU getting 1/N of each.
RESOURCE_COUNT = "alnair/vgpu-count"
# Memory as a share of each of the container's GPUs, in percent (1..100), instead of alnair/vgpu-memory units:
# converted on the GPUs it lands on (fit.percent_units). Registered by no device plugin either (like
# alnair/vgpu-count): GPUs differ, so no node can offer it as a count; kubelet leaves it out and the extender and
# the agent read it from the pod. The container must ask for alnair/vgpu-compute too: kubelet calls the agent
# (Allocate) only for the device plugin resources a container asks for.
RESOURCE_MEMORY_PERCENT = "alnair/vgpu-memory-percent"

# Device IDs name their GPU so any ID maps back to it: "<GPU-UUID>::mem::<k>" / "<GPU-UUID>::sm::<k>".
DEVICE_ID_SEPARATOR = "::"
DEVICE_KIND = {RESOURCE_MEMORY: "mem", RESOURCE_COMPUTE: "sm"}

# -- kubelet device plugin API (v1beta1) -------------------------------------------------------------------
DEVICE_PLUGIN_API_VERSION = "v1beta1"
KUBELET_SOCKET_NAME = "kubelet.sock"
SOCKET_NAME = {RESOURCE_MEMORY: "alnair-vgpu-memory.sock", RESOURCE_COMPUTE: "alnair-vgpu-compute.sock"}
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

# -- what Allocate hands the container ---------------------------------------------------------------------
ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ENV_LD_PRELOAD = "LD_PRELOAD"
ENV_MEMORY_LIMIT = "ALNAIR_MEMORY_LIMIT"  # bytes
ENV_COMPUTE_LIMIT = "ALNAIR_COMPUTE_LIMIT"  # percent
ENV_REGION = "ALNAIR_REGION"
ENV_ALLOCATION_ID = "ALNAIR_ALLOCATION_ID"
# A container of several GPUs: the region of each, comma-separated, in the order of NVIDIA_VISIBLE_DEVICES (GPU index
# order = PCI bus order); the shim charges device ordinal k to the k-th. CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA's
# ordinals follow that order (its default, fastest first, may not).
ENV_REGIONS = "ALNAIR_REGIONS"
ENV_CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
CONTAINER_RUN_DIR = "/run/alnair"
CONTAINER_REGION_PATH = "/run/alnair/region"
# With ALNAIR_MPS_PIPE_DIR: the node's MPS pipe folder in every container, named to CUDA by this variable.
ENV_MPS_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
CONTAINER_MPS_PIPE_DIR = "/run/nvidia-mps"
# ... and the folder the MPS server has as /dev/shm (ALNAIR_MPS_SHM_DIR): a client maps the server's shared memory there.
CONTAINER_MPS_SHM_DIR = "/dev/shm"
# /proc/<pid>/comm of an MPS server (nvidia-cuda-mps-server, cut to 15 characters): NVML books its clients' work to it.
MPS_SERVER_COMM = "nvidia-cuda-mps"
CONTAINER_SHIM_DIR = "/opt/alnair/lib"
SHIM_LIBRARY = "libalnair.so"
CONTAINER_SHIM_PATH = f"{CONTAINER_SHIM_DIR}/{SHIM_LIBRARY}"
REGION_FILE_NAME = "region"
# Inside ALNAIR_WORKSPACE/<allocation-id>/: only this sub-folder is mounted into the container (read-write);
# the allocation record beside it stays out of the container's reach.
CONTAINER_FOLDER_NAME = "run"
ALLOCATION_FILE_NAME = "allocation.json"

# -- annotations (pods and nodes) ---------------------------------------------------------------------------
ANNOTATION_PREFIX = "ai.centaurus.io/"
NODE_GPU_DEVICES = ANNOTATION_PREFIX + "gpu-devices"  # JSON: GPU inventory and allocation of the node
# The profiler's figures of every Alnair container of a pod: one JSON object keyed by container name
# (schema: alnair_agent.profiler.usage.FIELDS). It stays on the pod after its containers end.
USAGE_ANNOTATION = ANNOTATION_PREFIX + "usage"
# A pod's compute policy for all its containers: "strict" (the cap is a ceiling) or "elastic" (may borrow GPU time
# no other container on the GPU wants); absent: ALNAIR_COMPUTE_POLICY. A bad value: logged, the default applies.
COMPUTE_POLICY_ANNOTATION = ANNOTATION_PREFIX + "compute-policy"

# NVML Xid errors caused by the application, not the GPU: they do not make a device unhealthy.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# -- DRA front-end (resource.k8s.io/v1, kubelet DRA plugin) ------------------------------------------------
# The driver name (ResourceSlice spec.driver, allocation results, plugin registration) and the DeviceClass that
# selects its devices: both under the project's centaurus.io domain.
DRA_DRIVER = "gpu.alnair.centaurus.io"
DRA_DEVICE_CLASS = "gpu.alnair.centaurus.io"
DRA_API_GROUP_VERSION = "resource.k8s.io/v1"
# One device per healthy GPU, named by the GPU's index (a DNS label); its attributes and consumable capacities.
DRA_DEVICE_PREFIX = "gpu-"
DRA_ATTR_UUID = "uuid"
DRA_ATTR_INDEX = "index"
DRA_ATTR_PRODUCT = "productName"
DRA_ATTR_MEMORY = "memory"  # the GPU's whole memory in bytes (an int attribute, for selectors)
DRA_CAP_MEMORY = "memory"  # bytes; request policy step = ALNAIR_MEMORY_UNIT_MIB
DRA_CAP_COMPUTE = "compute"  # percent of the GPU; step 1
# gRPC services the plugin offers kubelet, most preferred first (kubelet picks the first it knows).
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
DRA_PLUGIN_TYPE = "DRAPlugin"
DRA_SOCKET_NAME = "dra.sock"  # in ALNAIR_DRA_PLUGIN_DIR
DRA_REGISTRATION_SOCKET = DRA_DRIVER + "-reg.sock"  # in ALNAIR_PLUGINS_REGISTRY_DIR
# CDI: the kind of the devices the plugin hands kubelet ("<kind>=<allocation id>"), one spec file per claim.
CDI_KIND = "alnair.centaurus.io/gpu"
CDI_VERSION = "0.6.0"
CDI_SPEC_PREFIX = "alnair.centaurus.io-gpu_"  # + claim UID + ".json"
