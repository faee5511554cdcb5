/* A fake libnvidia-ml.so.1 for testing the shim's NVML hooks without a GPU: two devices of
 * GPULOOM_FAKE_CUDA_MEM_MIB each. Device 0 (UUID GPU-fa4e0000-...) is the fake driver's: the
 * bytes this process holds through the fake libcuda are its used memory (looked up in the
 * process at run time; without the fake libcuda loaded, nothing is used). Device 1 (UUID
 * GPU-fa4e0001-...) is a GPU of the same node the process was not given: nothing used. Only
 * what the tests call: nvmlInit(_v2), nvmlShutdown, nvmlDeviceGetCount_v2,
 * nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetUUID, nvmlDeviceGetMemoryInfo(_v2). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "gl_nvml.h"

#define EXPORT __attribute__((visibility("default")))

static int g_device_tokens[2];
static int g_inited;

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    g_inited = 1;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    g_inited = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!g_inited) return NVML_ERROR_UNINITIALIZED;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 2;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!g_inited) return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index > 1) return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)&g_device_tokens[index];
    return NVML_SUCCESS;
}

/* 0 or 1; -1 for anything else. */
static int device_index(nvmlDevice_t device) {
    for (int i = 0; i < 2; i++)
        if (device == (nvmlDevice_t)&g_device_tokens[i]) return i;
    return -1;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (!g_inited) return NVML_ERROR_UNINITIALIZED;
    int index = device_index(device);
    if (index < 0 || uuid == NULL || length < 41) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(uuid, length, "GPU-fa4e000%d-0000-0000-0000-000000000000", index);
    return NVML_SUCCESS;
}

static nvmlReturn_t memory(nvmlDevice_t device, uint64_t *total, uint64_t *used) {
    if (!g_inited) return NVML_ERROR_UNINITIALIZED;
    int index = device_index(device);
    if (index < 0) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t (*used_fn)(void) = (uint64_t (*)(void))dlsym(RTLD_DEFAULT, "gl_fake_cuda_mem_used");
    const char *mib = getenv("GPULOOM_FAKE_CUDA_MEM_MIB");
    *total = (uint64_t)(mib && *mib ? strtoull(mib, NULL, 10) : 81920) << 20;
    *used = index == 0 && used_fn ? used_fn() : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *out) {
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t total, used;
    nvmlReturn_t r = memory(device, &total, &used);
    if (r != NVML_SUCCESS) return r;
    out->total = total;
    out->used = used;
    out->free = total - used;
    return NVML_SUCCESS;
}

/* The fake driver keeps no memory of its own: reserved is 0 (a real one reports some). */
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *out) {
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (out->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    uint64_t total, used;
    nvmlReturn_t r = memory(device, &total, &used);
    if (r != NVML_SUCCESS) return r;
    out->total = total;
    out->reserved = 0;
    out->used = used;
    out->free = total - used;
    return NVML_SUCCESS;
}
