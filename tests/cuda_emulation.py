"""CUDA kernels run on the CPU for the tests: each GPU thread a CPU thread.

``SHIM`` goes in front of a kernel source compiled by ``g++ -std=c++20``: the
CUDA qualifiers become nothing (``__shared__`` a static, which is right
because blocks run one after another), ``__syncthreads`` a barrier over the
block's threads, the round-to-nearest intrinsics plain float operations (the
build adds ``-ffp-contract=off``, so nothing is fused). ``cl_launch_grid(f,
grid, bx, by, args...)`` runs a 1-D grid of 2-D blocks, ``cl_launch(f,
block, args...)`` one 1-D block. Used by the CompLL round program's CUDA
(tests/unit/test_compll_powersgd.py) and the hand-written PowerSGD's
(tests/unit/test_native_powersgd.py), where a GPU is not at hand.
"""

SHIM = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#include <barrier>
#include <thread>
#include <vector>
struct cl_dim3_ { unsigned int x, y, z; };
static thread_local cl_dim3_ threadIdx, blockIdx;
static cl_dim3_ blockDim, gridDim;
static std::barrier<>* cl_bar_;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define CL_INLINE static inline
static inline void __syncthreads() { cl_bar_->arrive_and_wait(); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
CL_INLINE void cl_memcpy(void* d, const void* s, int k) { memcpy(d, s, k); }
template <class F, class... A>
static void cl_launch_grid(F f, unsigned int gx, unsigned int bx, unsigned int by, A... a) {
    gridDim = {gx, 1, 1};
    blockDim = {bx, by, 1};
    for (unsigned int b = 0; b < gx; ++b) {
        std::barrier<> bar(bx * by);
        cl_bar_ = &bar;
        std::vector<std::thread> ts;
        for (unsigned int y = 0; y < by; ++y)
            for (unsigned int x = 0; x < bx; ++x)
                ts.emplace_back([=] { threadIdx = {x, y, 0}; blockIdx = {b, 0, 0}; f(a...); });
        for (auto& t : ts) t.join();
    }
}
template <class F, class... A> static void cl_launch(F f, unsigned int block, A... a) {
    cl_launch_grid(f, 1, block, 1, a...);
}
"""
