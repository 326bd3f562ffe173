/*
 * A libnvidia-ml.so.1 that does nothing, shaped like a node of H100s, for bench/bench_nvml_threads.py and tests/exporter/test_nvml_stub_driver.py.
 *
 * It exports the NVML functions the exporter's reader calls, with the C signatures pynvml calls them
 * by, so pynvml's own wrappers run as on a GPU machine and ctypes releases the GIL around every call.
 * Every GPU is healthy: 18 active NVLink links with zero error counts, no ECC errors, PCIe Gen5 x16;
 * retired pages are unsupported, as on Hopper.
 *
 * Environment:
 *   NVML_STUB_GPUS       GPUs on the node (default 8)
 *   NVML_STUB_CALL_NS    CPU time each call spends, standing in for the driver (default 0)
 *   NVML_STUB_SAMPLE_NS  time nvmlDeviceGetPcieThroughput sleeps, as the real one samples (default 0;
 *                        NVML documents 20 ms)
 *   NVML_STUB_STATE_CALL_FAILS  1: nvmlDeviceGetNvLinkState answers UNKNOWN, so a reader that asks
 *                        link by link rather than through nvmlDeviceGetFieldValues shows errors
 *   NVML_STUB_HANG_GPU   index of a GPU whose nvmlDeviceGetPowerUsage blocks for 60 s, as a call into
 *                        a wedged GPU does (default none)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;

enum { SUCCESS = 0, INVALID_ARGUMENT = 2, NOT_SUPPORTED = 3, UNKNOWN = 999 };
enum { LINKS = 18, FI_DEV_NVLINK_GET_STATE = 165, VALUE_TYPE_UNSIGNED_INT = 1 };

typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    unsigned long long value;
} nvmlFieldValue_t;

static long setting(const char *name, long fallback) {
    const char *text = getenv(name);
    return text ? atol(text) : fallback;
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Returns `result` after spending NVML_STUB_CALL_NS of CPU time. */
static nvmlReturn_t call(nvmlReturn_t result) {
    static long spend = -1;
    if (spend < 0) spend = setting("NVML_STUB_CALL_NS", 0);
    if (spend > 0) {
        long until = now_ns() + spend;
        while (now_ns() < until) {
        }
    }
    return result;
}

static long gpu(nvmlDevice_t device) { return (long)device - 1; }

const char *nvmlErrorString(nvmlReturn_t result) { return result == NOT_SUPPORTED ? "Not Supported" : "Error"; }
nvmlReturn_t nvmlInitWithFlags(unsigned flags) { (void)flags; return SUCCESS; }
nvmlReturn_t nvmlShutdown(void) { return SUCCESS; }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
    *count = (unsigned)setting("NVML_STUB_GPUS", 8);
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *device) {
    *device = (nvmlDevice_t)(long)(index + 1);
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned length) {
    snprintf(uuid, length, "GPU-00000000-0000-0000-0000-%012ld", gpu(device));
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned length) {
    (void)device;
    snprintf(name, length, "NVIDIA H100 80GB HBM3");
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *info) {
    memset(info, 0, sizeof *info);
    snprintf(info->busId, sizeof info->busId, "00000000:%02lX:00.0", (0x18 + 0x10 * gpu(device)) & 0xff);
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int type, int counter, unsigned long long *count) {
    (void)device, (void)type, (void)counter;
    *count = 0;
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned *corr, unsigned *unc, unsigned *pending,
                                       unsigned *failure) {
    (void)device;
    *corr = *unc = *pending = *failure = 0;
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause, unsigned *count, unsigned long long *pages) {
    (void)device, (void)cause, (void)count, (void)pages;
    return call(NOT_SUPPORTED);
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *pending) {
    (void)device, (void)pending;
    return call(NOT_SUPPORTED);
}

static nvmlReturn_t answer(unsigned *out, unsigned value) {
    *out = value;
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned *v) { (void)d; return answer(v, 5); }
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned *v) { (void)d; return answer(v, 5); }
nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned *v) { (void)d; return answer(v, 16); }
nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned *v) { (void)d; return answer(v, 16); }
nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t d, unsigned *v) { (void)d; return answer(v, 0); }
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *v) { (void)d, (void)sensor; return answer(v, 40); }

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned *value) {
    if (gpu(device) == setting("NVML_STUB_HANG_GPU", -1)) {
        struct timespec wedged = {60, 0};
        nanosleep(&wedged, NULL);
    }
    return answer(value, 500000);
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, int counter, unsigned *value) {
    (void)device, (void)counter;
    long sample = setting("NVML_STUB_SAMPLE_NS", 0);
    struct timespec pause = {sample / 1000000000L, sample % 1000000000L};
    if (sample > 0) nanosleep(&pause, NULL);
    return answer(value, 0);
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count, nvmlFieldValue_t *values) {
    (void)device;
    for (int i = 0; i < count; i++) {
        int state = values[i].fieldId == FI_DEV_NVLINK_GET_STATE && values[i].scopeId < LINKS;
        values[i].valueType = VALUE_TYPE_UNSIGNED_INT;
        values[i].nvmlReturn = state ? SUCCESS : NOT_SUPPORTED;
        values[i].value = state ? 1 : 0;
    }
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned link, int *active) {
    (void)device;
    if (link >= LINKS) return call(INVALID_ARGUMENT);
    if (setting("NVML_STUB_STATE_CALL_FAILS", 0)) return call(UNKNOWN);
    *active = 1;
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned link, int counter,
                                             unsigned long long *value) {
    (void)device, (void)counter;
    if (link >= LINKS) return call(INVALID_ARGUMENT);
    *value = 0;
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    (void)device;
    *reasons = 0;
    return call(SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSupportedClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    (void)device;
    *reasons = 0x1ff;
    return call(SUCCESS);
}
