/* The legacy (un-suffixed) ABI entry points that libcuda still exports for programs built
 * against a cuda.h older than 3.2: 32-bit device pointers and sizes. cuda.h maps these names
 * to their _v2 successors with macros and declares the originals only for the driver's own
 * build (__CUDA_API_VERSION_INTERNAL), so they are declared here, from cuda.h's own
 * declarations. Included by the shim (which hooks them, so that no allocation escapes the
 * memory cap through them) and by the fake driver (which implements them); after this header
 * the names mean the legacy functions, so code that means the current ones names the _v2. */
#ifndef GL_CUDA_LEGACY_H
#define GL_CUDA_LEGACY_H

#include <stdint.h>

#include "gl_cuda.h"

#undef cuMemAlloc
#undef cuMemAllocPitch
#undef cuMemFree
#undef cuMemGetInfo
#undef cuArrayCreate
#undef cuArray3DCreate

typedef unsigned int gl_deviceptr_v1; /* cuda.h's CUdeviceptr_v1 */

typedef struct {
    unsigned int Width;
    unsigned int Height;
    CUarray_format Format;
    unsigned int NumChannels;
} gl_array_descriptor_v1; /* cuda.h's CUDA_ARRAY_DESCRIPTOR_v1 */

typedef struct {
    unsigned int Width;
    unsigned int Height;
    unsigned int Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} gl_array3d_descriptor_v1; /* cuda.h's CUDA_ARRAY3D_DESCRIPTOR_v1 */

CUresult CUDAAPI cuMemAlloc(gl_deviceptr_v1 *dptr, unsigned int bytesize);
CUresult CUDAAPI cuMemAllocPitch(gl_deviceptr_v1 *dptr, unsigned int *pitch,
                                 unsigned int width_bytes, unsigned int height,
                                 unsigned int element_bytes);
CUresult CUDAAPI cuMemFree(gl_deviceptr_v1 dptr);
CUresult CUDAAPI cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes);
CUresult CUDAAPI cuArrayCreate(CUarray *handle, const gl_array_descriptor_v1 *desc);
CUresult CUDAAPI cuArray3DCreate(CUarray *handle, const gl_array3d_descriptor_v1 *desc);

/* The bytes of one element of `format` (0: a format the shim does not know). */
static inline unsigned gl_format_bytes(CUarray_format format) {
    switch ((int)format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
        return 4;
    default:
        return 0;
    }
}

/* The bytes of an array: width x max(height,1) x max(depth,1) x channels x element bytes, the
 * unpadded size (the driver may pad rows; the shim asks the driver for the real size after
 * creation when it can). An unknown format counts 16 bytes per channel (the widest element:
 * errs on the side of refusing). Saturates instead of wrapping. */
static inline uint64_t gl_array_bytes(uint64_t width, uint64_t height, uint64_t depth,
                                      CUarray_format format, unsigned channels) {
    uint64_t element = gl_format_bytes(format);
    if (element == 0) element = 16;
    uint64_t n = element * (channels ? channels : 1);
    uint64_t dims[3] = {width ? width : 1, height ? height : 1, depth ? depth : 1};
    for (int i = 0; i < 3; i++) {
        if (n > UINT64_MAX / dims[i]) return UINT64_MAX;
        n *= dims[i];
    }
    return n;
}

/* A mipmapped array's bytes: each level halves each dimension (not below 1). */
static inline uint64_t gl_mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
    uint64_t total = 0, w = d->Width, h = d->Height, z = d->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t level = gl_array_bytes(w, h, z, d->Format, d->NumChannels);
        if (level > UINT64_MAX - total) return UINT64_MAX;
        total += level;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : (h ? 1 : 0);
        z = z > 1 ? z / 2 : (z ? 1 : 0);
    }
    return total;
}

#endif
