/* Graph identity: a CUDA graph is admitted and measured as one unit, so it needs an ID the
 * profile can hold and admission can look up, as a kernel has. When a graph is instantiated
 * the shim reads its nodes (cuGraphGetNodes, in the driver's order: the order they were
 * added) and hashes its structure:
 *
 *   FNV-1a 64 over, for each node, u32le(node type), then for a kernel node u64le(its kernel
 *   ID: the function's name and the six launch dimensions, as names.c computes it)
 *
 * (other nodes by their type only: a copy's size or a child graph's kernels are not in it)
 *
 * The graph is then named "<graph:HHHHHHHHHHHHHHHH>" (the hash, 16 lowercase hex digits) with
 * all six dimensions 0, and its ID is that name's kernel ID: the same graph captured by the
 * same program has the same ID in every run. The executable keeps the ID until it is
 * destroyed; an executable whose kernels change after instantiation
 * (cuGraphExecKernelNodeSetParams) loses it, one updated from a graph (cuGraphExecUpdate)
 * takes that graph's. A graph without an ID (instantiated by an entry point the shim does not
 * hook, cuGraphInstantiate_v2 of CUDA 11, or whose nodes the driver cannot list) is launched
 * as "<graph>" with ID 0: admitted as a unit of unknown length and not measured.
 * Owns: g_graphs, g_graphs_lock. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>

#include "shim_internal.h"

#define GRAPH_BUCKETS 256
typedef struct graph_entry {
    CUgraphExec exec;
    uint64_t structure;
    uint64_t id;
    struct graph_entry *next;
} graph_entry;
static graph_entry *g_graphs[GRAPH_BUCKETS];
static pthread_mutex_t g_graphs_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t graph_bucket(CUgraphExec exec) {
    return (size_t)(((uintptr_t)exec >> 4) * 0x9E3779B97F4A7C15ull >> 56) % GRAPH_BUCKETS;
}

static uint64_t fnv_bytes(uint64_t h, uint64_t value, int bytes) {
    for (int b = 0; b < bytes; b++) {
        h ^= (value >> (8 * b)) & 0xff;
        h *= 0x100000001b3ull;
    }
    return h;
}

#define GRAPH_NODES_MAX 65536 /* a larger graph gets no ID */

/* The structure hash of `graph`, or 0 when it cannot be read. */
static uint64_t graph_structure(CUgraph graph) {
    if (graph == NULL || g_aux.graph_get_nodes == NULL || g_aux.node_get_type == NULL ||
        g_aux.kernel_node_get_params == NULL)
        return 0;
    size_t count = 0;
    if (g_aux.graph_get_nodes(graph, NULL, &count) != CUDA_SUCCESS || count > GRAPH_NODES_MAX)
        return 0;
    CUgraphNode *nodes = calloc(count ? count : 1, sizeof *nodes);
    if (nodes == NULL) return 0;
    size_t got = count;
    uint64_t h = 0xcbf29ce484222325ull;
    int ok = g_aux.graph_get_nodes(graph, nodes, &got) == CUDA_SUCCESS && got == count;
    for (size_t i = 0; ok && i < count; i++) {
        CUgraphNodeType type;
        ok = g_aux.node_get_type(nodes[i], &type) == CUDA_SUCCESS;
        if (!ok) break;
        h = fnv_bytes(h, (uint32_t)type, 4);
        if (type != CU_GRAPH_NODE_TYPE_KERNEL) continue;
        CUDA_KERNEL_NODE_PARAMS p = {0};
        ok = g_aux.kernel_node_get_params(nodes[i], &p) == CUDA_SUCCESS;
        /* A CUDA 12 node may name a CUkernel instead of a function (launchable as one). */
        CUfunction f = p.func ? p.func : (CUfunction)p.kern;
        unsigned dims[6] = {p.gridDimX,  p.gridDimY,  p.gridDimZ,
                            p.blockDimX, p.blockDimY, p.blockDimZ};
        if (ok) h = fnv_bytes(h, function_kernel_id(f, dims), 8);
    }
    free(nodes);
    return ok && h != 0 ? h : 0;
}

void graph_name(uint64_t structure, char *out, size_t size) {
    if (structure == 0)
        snprintf(out, size, "<graph>");
    else
        snprintf(out, size, "<graph:%016llx>", (unsigned long long)structure);
}

static void graph_forget(CUgraphExec exec) {
    pthread_mutex_lock(&g_graphs_lock);
    for (graph_entry **p = &g_graphs[graph_bucket(exec)]; *p; p = &(*p)->next)
        if ((*p)->exec == exec) {
            graph_entry *dead = *p;
            *p = dead->next;
            free(dead);
            break;
        }
    pthread_mutex_unlock(&g_graphs_lock);
}

/* `exec` is `graph`'s executable (now, or again after an update). */
static void graph_remember(CUgraphExec exec, CUgraph graph) {
    graph_forget(exec);
    uint64_t structure = graph_structure(graph);
    if (structure == 0) return;
    char name[40];
    graph_name(structure, name, sizeof name);
    static const unsigned zero[6] = {0};
    graph_entry *e = malloc(sizeof *e);
    if (e == NULL) return;
    *e = (graph_entry){exec, structure, kernel_id(name, zero), NULL};
    pthread_mutex_lock(&g_graphs_lock);
    size_t b = graph_bucket(exec);
    e->next = g_graphs[b];
    g_graphs[b] = e;
    pthread_mutex_unlock(&g_graphs_lock);
    trace("graph %p %s %016llx", (void *)exec, name, (unsigned long long)e->id);
}

uint64_t graph_identity(CUgraphExec exec, uint64_t *structure) {
    uint64_t id = 0;
    *structure = 0;
    pthread_mutex_lock(&g_graphs_lock);
    for (graph_entry *e = g_graphs[graph_bucket(exec)]; e; e = e->next)
        if (e->exec == exec) {
            id = e->id;
            *structure = e->structure;
            break;
        }
    pthread_mutex_unlock(&g_graphs_lock);
    return id;
}

EXPORT CUresult CUDAAPI cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph,
                                                    unsigned long long flags) {
    init();
    if (!REAL(cuGraphInstantiateWithFlags)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGraphInstantiateWithFlags)(exec, graph, flags);
    if (r == CUDA_SUCCESS && exec) graph_remember(*exec, graph);
    return r;
}

static ALWAYS_INLINE CUresult cuGraphInstantiateWithParams_body(
    int hook, int per_thread, CUgraphExec *exec, CUgraph graph,
    CUDA_GRAPH_INSTANTIATE_PARAMS *params) {
    (void)per_thread;
    init();
    if (!REAL_AT(cuGraphInstantiateWithParams, hook)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL_AT(cuGraphInstantiateWithParams, hook)(exec, graph, params);
    if (r == CUDA_SUCCESS && exec) graph_remember(*exec, graph);
    return r;
}

GL_TWIN_HOOKS(cuGraphInstantiateWithParams, _ptsz,
              (CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params),
              (exec, graph, params))

EXPORT CUresult CUDAAPI cuGraphExecDestroy(CUgraphExec exec) {
    init();
    if (!REAL(cuGraphExecDestroy)) return CUDA_ERROR_NOT_FOUND;
    graph_forget(exec);
    return REAL(cuGraphExecDestroy)(exec);
}

EXPORT CUresult CUDAAPI cuGraphExecUpdate_v2(CUgraphExec exec, CUgraph graph,
                                             CUgraphExecUpdateResultInfo *info) {
    init();
    if (!REAL(cuGraphExecUpdate_v2)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGraphExecUpdate_v2)(exec, graph, info);
    if (r == CUDA_SUCCESS) graph_remember(exec, graph);
    return r;
}

EXPORT CUresult CUDAAPI cuGraphExecKernelNodeSetParams_v2(CUgraphExec exec, CUgraphNode node,
                                                          const CUDA_KERNEL_NODE_PARAMS *params) {
    init();
    if (!REAL(cuGraphExecKernelNodeSetParams_v2)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGraphExecKernelNodeSetParams_v2)(exec, node, params);
    if (r == CUDA_SUCCESS) {
        graph_forget(exec);
        trace("graph %p forgotten", (void *)exec);
    }
    return r;
}
