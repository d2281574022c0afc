/* Prototypes of every hooked function, as the real libraries define them. Each module that defines a hook
 * includes this, so the compiler checks the definitions against one list; hooks.c takes their addresses. */
#ifndef ALNAIR_HOOK_PROTOS_H
#define ALNAIR_HOOK_PROTOS_H
#include "alnair.h"

#define P ALNAIR_API
P CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
P CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                               CUdriverProcAddressQueryResult *symbolStatus);

P CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
P CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                              unsigned int ElementSizeBytes);
P CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
P CUresult cuMemFree_v2(CUdeviceptr dptr);
P CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                       unsigned long long flags);
P CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
P CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                    unsigned long long flags);
P CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
P CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
P CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
P CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream);
P CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream);
P CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
P CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
P CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value);
P CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);
P CUresult cuMemPoolDestroy(CUmemoryPool pool);
P CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                  size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams);
P CUresult cuDeviceGraphMemTrim(CUdevice device);
P CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray);
P CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray);
P CUresult cuArrayDestroy(CUarray hArray);
P CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pDesc,
                                  unsigned int numMipmapLevels);
P CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray);
P CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
P CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);

P CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
P CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams, unsigned int flags,
                          CUdevice dev);
P CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags, CUdevice dev);
P CUresult cuCtxDestroy_v2(CUcontext ctx);
P CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
P CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
P CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);

#define LAUNCH_ARGS                                                                                             \
    CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, \
        unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream
P CUresult cuLaunchKernel(LAUNCH_ARGS, void **kernelParams, void **extra);
P CUresult cuLaunchKernel_ptsz(LAUNCH_ARGS, void **kernelParams, void **extra);
P CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra);
P CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra);
P CUresult cuLaunchCooperativeKernel(LAUNCH_ARGS, void **kernelParams);
P CUresult cuLaunchCooperativeKernel_ptsz(LAUNCH_ARGS, void **kernelParams);
P CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
P CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream);
P CUresult cuLaunch(CUfunction f);
P CUresult cuStreamSynchronize(CUstream hStream);
P CUresult cuStreamSynchronize_ptsz(CUstream hStream);
P CUresult cuEventSynchronize(CUevent hEvent);
P CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount);
P CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount);
P CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
P CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
P CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
P CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
P CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
P CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
P CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
P CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
P CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream);
P CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream);
P CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
P CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
P CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
P CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                     CUstream hStream);
P CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height);
P CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream);
P CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList, unsigned int numDevices,
                                                unsigned int flags);
#undef LAUNCH_ARGS

P CUresult cuStreamBeginCapture(CUstream hStream);
P CUresult cuStreamBeginCapture_ptsz(CUstream hStream);
P CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode);
P CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode);
P CUresult cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies,
                                       const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                       CUstreamCaptureMode mode);
P CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies,
                                            const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                            CUstreamCaptureMode mode);
P CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
P CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph);

P nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
P nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory);
P nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                   nvmlProcessInfo_v1_t *infos);
P nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_v2_t *infos);
P nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_v2_t *infos);
P nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                    nvmlProcessInfo_v1_t *infos);
P nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                       nvmlProcessInfo_v2_t *infos);
P nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                       nvmlProcessInfo_v2_t *infos);
P nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_v1_t *infos);
P nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_v2_t *infos);
P nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_v2_t *infos);
P nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                               unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp);
P nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                     nvmlProcessesUtilizationInfo_t *procesesUtilInfo);
#undef P
#endif
