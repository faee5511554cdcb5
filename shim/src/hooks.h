/* The one list of hooked driver symbols.
 *
 *   HOOK(symbol, query, min_version, per_thread)
 *
 * symbol      the exported ABI name the shim defines (and resolves in the real libcuda);
 * query       the name cudart passes to cuGetProcAddress for it;
 * min_version the cudaVersion from which cuGetProcAddress answers `query` with this symbol;
 * per_thread  1 for the per-thread-default-stream (_ptsz/_ptds) variant.
 *
 * Symbols starting with "nvml" are NVML's (libnvidia-ml.so.1, resolved when first called, see
 * driver.c); cuGetProcAddress never answers them (their query is no driver name).
 *
 * The linker version script (generated from this list) exports exactly these plus dlsym. */
#define GL_HOOKS(HOOK)                                                  \
    HOOK(cuInit, "cuInit", 2000, 0)                                     \
    HOOK(cuGetProcAddress, "cuGetProcAddress", 11030, 0)                \
    HOOK(cuGetProcAddress_v2, "cuGetProcAddress", 12000, 0)             \
    HOOK(cuModuleGetFunction, "cuModuleGetFunction", 2000, 0)           \
    HOOK(cuModuleUnload, "cuModuleUnload", 2000, 0)                     \
    HOOK(cuLibraryGetKernel, "cuLibraryGetKernel", 12000, 0)            \
    HOOK(cuLibraryUnload, "cuLibraryUnload", 12000, 0)                  \
    HOOK(cuKernelGetFunction, "cuKernelGetFunction", 12000, 0)          \
    HOOK(cuLaunchKernel, "cuLaunchKernel", 4000, 0)                     \
    HOOK(cuLaunchKernel_ptsz, "cuLaunchKernel", 7000, 1)                \
    HOOK(cuLaunchKernelEx, "cuLaunchKernelEx", 11060, 0)                \
    HOOK(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 11060, 1)           \
    HOOK(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000, 0) \
    HOOK(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 9000, 1) \
    HOOK(cuGraphLaunch, "cuGraphLaunch", 10000, 0)                      \
    HOOK(cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, 1)                 \
    HOOK(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", 11040, 0) \
    HOOK(cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 12000, 0) \
    HOOK(cuGraphInstantiateWithParams_ptsz, "cuGraphInstantiateWithParams", 12000, 1) \
    HOOK(cuGraphExecDestroy, "cuGraphExecDestroy", 10000, 0)            \
    HOOK(cuGraphExecUpdate_v2, "cuGraphExecUpdate", 12000, 0)           \
    HOOK(cuGraphExecKernelNodeSetParams_v2, "cuGraphExecKernelNodeSetParams", 12000, 0) \
    HOOK(cuCtxSynchronize, "cuCtxSynchronize", 2000, 0)                 \
    HOOK(cuStreamSynchronize, "cuStreamSynchronize", 2000, 0)           \
    HOOK(cuStreamSynchronize_ptsz, "cuStreamSynchronize", 7000, 1)      \
    HOOK(cuEventSynchronize, "cuEventSynchronize", 2000, 0)             \
    HOOK(cuMemcpyDtoH_v2, "cuMemcpyDtoH", 3020, 0)                      \
    HOOK(cuMemcpyDtoH_v2_ptds, "cuMemcpyDtoH", 7000, 1)                 \
    HOOK(cuMemAlloc_v2, "cuMemAlloc", 3020, 0)                          \
    HOOK(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0)                \
    HOOK(cuMemAllocManaged, "cuMemAllocManaged", 6000, 0)               \
    HOOK(cuMemAllocAsync, "cuMemAllocAsync", 11020, 0)                  \
    HOOK(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, 1)             \
    HOOK(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, 0)  \
    HOOK(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, 1) \
    HOOK(cuMemCreate, "cuMemCreate", 10020, 0)                          \
    HOOK(cuMemRelease, "cuMemRelease", 10020, 0)                        \
    HOOK(cuMemMap, "cuMemMap", 10020, 0)                                \
    HOOK(cuMemUnmap, "cuMemUnmap", 10020, 0)                            \
    HOOK(cuMemFree_v2, "cuMemFree", 3020, 0)                            \
    HOOK(cuMemFreeAsync, "cuMemFreeAsync", 11020, 0)                    \
    HOOK(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, 1)               \
    HOOK(cuMemGetInfo_v2, "cuMemGetInfo", 3020, 0)                      \
    HOOK(cuMemAlloc, "cuMemAlloc", 2000, 0)                             \
    HOOK(cuMemAllocPitch, "cuMemAllocPitch", 2000, 0)                   \
    HOOK(cuMemFree, "cuMemFree", 2000, 0)                               \
    HOOK(cuMemGetInfo, "cuMemGetInfo", 2000, 0)                         \
    HOOK(cuArrayCreate, "cuArrayCreate", 2000, 0)                       \
    HOOK(cuArrayCreate_v2, "cuArrayCreate", 3020, 0)                    \
    HOOK(cuArray3DCreate, "cuArray3DCreate", 2000, 0)                   \
    HOOK(cuArray3DCreate_v2, "cuArray3DCreate", 3020, 0)                \
    HOOK(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 5000, 0)     \
    HOOK(cuArrayDestroy, "cuArrayDestroy", 2000, 0)                     \
    HOOK(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 5000, 0)   \
    HOOK(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", 11040, 0)    \
    HOOK(cuGraphAddNode, "cuGraphAddNode", 12020, 0)                    \
    HOOK(cuGraphAddNode_v2, "cuGraphAddNode", 12030, 0)                 \
    HOOK(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 11020, 0)      \
    HOOK(cuMemPoolTrimTo, "cuMemPoolTrimTo", 11020, 0)                  \
    HOOK(cuMemPoolDestroy, "cuMemPoolDestroy", 11020, 0)                \
    HOOK(nvmlDeviceGetMemoryInfo, "nvmlDeviceGetMemoryInfo", 0, 0)      \
    HOOK(nvmlDeviceGetMemoryInfo_v2, "nvmlDeviceGetMemoryInfo_v2", 0, 0)
