/* The slice of the CUDA driver and NVML ABIs the shim needs, declared here so the shim builds with a C compiler
 * alone (no CUDA toolkit at build time). Values and layouts follow cuda.h / nvml.h; they are part of NVIDIA's
 * stable ABI. */
#ifndef ALNAIR_CUDA_ABI_H
#define ALNAIR_CUDA_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUmemAllocationProp_st CUmemAllocationProp; /* opaque to the shim */
typedef struct CUexecAffinityParam_st CUexecAffinityParam; /* opaque to the shim */
typedef struct CUctxCreateParams_st CUctxCreateParams;     /* opaque to the shim */
typedef struct CUgraphEdgeData_st CUgraphEdgeData;         /* opaque to the shim */
typedef struct CUlaunchAttribute_st CUlaunchAttribute;     /* opaque to the shim */
typedef int CUstreamCaptureMode;
typedef int CUmemPool_attribute;
typedef struct CUDA_MEM_ALLOC_NODE_PARAMS_st CUDA_MEM_ALLOC_NODE_PARAMS; /* opaque to the shim */
typedef int CUstreamCaptureStatus;
typedef int CUdriverProcAddressQueryResult;
typedef int CUarray_format;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901

#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CU_EVENT_DEFAULT 0x0
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 0x2ull
#define CU_GET_PROC_ADDRESS_SUCCESS 0
#define CU_DEVICE_ATTRIBUTE_MPS_ENABLED 133 /* CUDA 12.4 and later: contexts on the device are an MPS server's */

typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

typedef struct CUDA_LAUNCH_PARAMS_st {
    CUfunction function;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void **kernelParams;
} CUDA_LAUNCH_PARAMS;

typedef struct CUDA_ARRAY_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct CUDA_ARRAY3D_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    size_t Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

/* NVML */
typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
#define NVML_SUCCESS 0
typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;
typedef struct nvmlMemory_v2_st {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct nvmlProcessInfo_v1_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;
typedef struct nvmlProcessInfo_v2_st { /* also nvmlProcessInfo_t of the _v3 calls */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;
typedef struct nvmlProcessUtilizationSample_st {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
typedef struct nvmlProcessUtilizationInfo_v1_st {
    unsigned long long timeStamp;
    unsigned int pid;
    unsigned int smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;
typedef struct nvmlProcessesUtilizationInfo_v1_st {
    unsigned int version;
    unsigned int processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_t;

#endif /* ALNAIR_CUDA_ABI_H */
