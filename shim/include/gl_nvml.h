/* The slice of NVML's ABI that the shim hooks and the fake libnvidia-ml implements: the memory
 * queries. Written from NVML's public API reference (no nvml.h is installed here); the layouts
 * are NVML's: nvmlMemory_t {total, free, used} and nvmlMemory_v2_t {version, total, reserved,
 * free, used}, all bytes. */
#ifndef GL_NVML_H
#define GL_NVML_H

typedef int nvmlReturn_t; /* an enum in nvml.h: int-sized */
typedef struct nvmlDevice_st *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory);

#endif
