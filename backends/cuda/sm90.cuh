/* Hopper (sm_90) building blocks shared by the kernels that stream tiles
 * with TMA into shared memory: mbarriers, the tensor-map loads, and the
 * driver's tensor-map encoder (looked up through the runtime, so that the
 * library needs no link against libcuda). Plain sm_90 PTX: no sm_90a
 * feature is used here. */
#ifndef FLOWMOE_CUDA_SM90_CUH
#define FLOWMOE_CUDA_SM90_CUH

#include <cudaTypedefs.h>
#include <stdint.h>

__device__ static __forceinline__ uint32_t sm90_sa(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ static __forceinline__ void sm90_bar_init(uint64_t *b, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sm90_sa(b)), "r"(count) : "memory");
}

/* Made visible to the other threads and to the TMA unit; then a CTA barrier. */
__device__ static __forceinline__ void sm90_bar_init_fence(void)
{
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ static __forceinline__ void sm90_bar_wait(uint64_t *b, int parity)
{
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(sm90_sa(b)), "r"(parity)
                     : "memory");
    } while (!done);
}

/* An arrival that also announces `bytes` of TMA traffic to come. */
__device__ static __forceinline__ void sm90_bar_expect(uint64_t *b, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sm90_sa(b)), "r"(bytes) : "memory");
}

/* A plain arrival (release: this thread's earlier shared-memory accesses
 * are ordered before it). */
__device__ static __forceinline__ void sm90_bar_arrive(uint64_t *b)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sm90_sa(b)) : "memory");
}

/* An arrival once this thread's cp.async copies issued so far have landed
 * (.noinc: the barrier's count includes it), for a producer that gathers
 * what TMA boxes cannot describe. */
__device__ static __forceinline__ void sm90_cp_async_arrive(uint64_t *b)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(sm90_sa(b)) : "memory");
}

/* One box of a 2-D tensor map into shared memory; c0 is the inner coordinate. */
__device__ static __forceinline__ void sm90_tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0,
                                                        int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
                 ::"r"(sm90_sa(dst)), "l"((uint64_t)map), "r"(sm90_sa(bar)), "r"(c0), "r"(c1)
                 : "memory");
}

/* ... of a 3-D one (c2 outermost, e.g. an expert). */
__device__ static __forceinline__ void sm90_tma_load_3d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0,
                                                        int c1, int c2)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
                 ::"r"(sm90_sa(dst)), "l"((uint64_t)map), "r"(sm90_sa(bar)), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}

/* The driver's cuTensorMapEncodeTiled, or NULL when the driver lacks it.
 * Racing first calls store the same pointer. */
static inline PFN_cuTensorMapEncodeTiled_v12000 sm90_tensor_map_encoder(void)
{
    static void *fn;
    static int looked;
    if (!looked) {
        void *f = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            f = NULL;
        fn = f;
        looked = 1;
    }
    return (PFN_cuTensorMapEncodeTiled_v12000)fn;
}

#endif
