// PowerSGD's products on a GPU in the lane order (compll/matrices.py; the bits of
// powersgd.c and of the CompLL program's generated CUDA): a sum over an index t of
// x_t is ((L0 + L1) + L2) ... + L7 with Lc = ((-0 + x_c) + x_{c+8}) + ..., float32
// products and sums with the round-to-nearest intrinsics (no contraction).
// Loaded by cuda.py through cupy; compile-checked by nvcc -ptx in the tests.

#define HP_NEG0 (-0.0f)
#define HP_MAX_RANK 8

// sum_t x[t sx] y[t sy] over t < n in the lane order (8 register lanes).
__device__ float hp_lane_dot(const float* x, long long sx, const float* y, long long sy,
                             long long n) {
    float L[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) L[l] = HP_NEG0;
    for (long long t0 = 0; t0 < n; t0 += 8) {
#pragma unroll
        for (int l = 0; l < 8; ++l)
            if (t0 + l < n) L[l] = __fadd_rn(L[l], __fmul_rn(x[(t0 + l) * sx], y[(t0 + l) * sy]));
    }
    float s = L[0];
#pragma unroll
    for (int l = 1; l < 8; ++l) s = __fadd_rn(s, L[l]);
    return s;
}

// Round 0's M: out = g + (e - P' Q'^T) (prev > 0) or g + e, elementwise; the outer
// products summed left to right from the first (lowrank._outer_sum's bits).
// out may be e (in place).
extern "C" __global__ void psgd_form_m(const float* e, const float* g, const float* pp,
                                       const float* qp, int prev, float* out, long long rows,
                                       long long cols) {
    const long long n = rows * cols;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < n;
         t += (long long)gridDim.x * blockDim.x) {
        float m;
        if (prev) {
            const long long i = t / cols, j = t % cols;
            float a = __fmul_rn(pp[i * prev], qp[j]);
            for (int k = 1; k < prev; ++k)
                a = __fadd_rn(a, __fmul_rn(pp[i * prev + k], qp[k * cols + j]));
            m = __fadd_rn(g[t], __fsub_rn(e[t], a));
        } else {
            m = __fadd_rn(g[t], e[t]);
        }
        out[t] = m;
    }
}

// P = M Q: p[i,k] = sum_j m[i,j] qt[k,j]. A block is (8 lanes x rank, 8 rows):
// thread (c + 8k, y) sums the columns j = c mod 8 of row i for k; lane c of the
// row's eight reads one consecutive 32-byte run per step. Thread c = 0 totals.
extern "C" __global__ void psgd_mq(const float* m, const float* qt, int rank, float* p,
                                   long long rows, long long cols) {
    __shared__ float lanes[8][HP_MAX_RANK][8];
    const int c = threadIdx.x & 7, k = threadIdx.x >> 3, y = threadIdx.y;
    const long long i = blockIdx.x * 8LL + y;
    float L = HP_NEG0;
    if (i < rows) {
        const float* mi = m + i * cols;
        const float* qk = qt + k * cols;
#pragma unroll 4
        for (long long j = c; j < cols; j += 8) L = __fadd_rn(L, __fmul_rn(mi[j], qk[j]));
    }
    lanes[y][k][c] = L;
    __syncthreads();
    if (c == 0 && i < rows) {
        float s = lanes[y][k][0];
#pragma unroll
        for (int l = 1; l < 8; ++l) s = __fadd_rn(s, lanes[y][k][l]);
        p[i * rank + k] = s;
    }
}

// Round 1's Q = M^T P: q[j,k] = sum_i m[i,j] p[i,k]. A block is (32 columns, 8 lanes):
// thread (x, c) sums the rows i = c mod 8 of column j for every k in registers (the
// 32 columns of a row are one coalesced read); thread c = 0 totals the lanes.
extern "C" __global__ void psgd_mtp(const float* m, const float* p, int rank, float* q,
                                    long long rows, long long cols) {
    __shared__ float lanes[8][HP_MAX_RANK][32];
    const int x = threadIdx.x, c = threadIdx.y;
    const long long j = blockIdx.x * 32LL + x;
    float acc[HP_MAX_RANK];
#pragma unroll
    for (int k = 0; k < HP_MAX_RANK; ++k) acc[k] = HP_NEG0;
    if (j < cols) {
        for (long long i = c; i < rows; i += 8) {
            const float v = m[i * cols + j];
#pragma unroll
            for (int k = 0; k < HP_MAX_RANK; ++k)
                if (k < rank) acc[k] = __fadd_rn(acc[k], __fmul_rn(v, p[i * rank + k]));
        }
    }
#pragma unroll
    for (int k = 0; k < HP_MAX_RANK; ++k)
        if (k < rank) lanes[c][k][x] = acc[k];
    __syncthreads();
    if (c == 0 && j < cols) {
        for (int k = 0; k < rank; ++k) {
            float s = lanes[0][k][x];
#pragma unroll
            for (int l = 1; l < 8; ++l) s = __fadd_rn(s, lanes[l][k][x]);
            q[j * rank + k] = s;
        }
    }
}

// Gram-Schmidt on the columns of a contiguous (rows, cols) matrix, in place, one
// block (ops.orthogonalize_'s steps; powersgd.c's hp_psgd_orthogonalize): a thread
// per earlier column for d, a thread per row for col -= prev d, thread 0 for the
// norm. d: cols floats of scratch.
extern "C" __global__ void psgd_orthogonalize(float* a, long long rows, long long cols,
                                              float* d) {
    __shared__ float den;
    for (long long i = 0; i < cols && rows > 0; ++i) {
        if (i) {
            for (long long l = threadIdx.x; l < i; l += blockDim.x)
                d[l] = hp_lane_dot(a + l, cols, a + i, cols, rows);
            __syncthreads();
            for (long long j = threadIdx.x; j < rows; j += blockDim.x)
                a[j * cols + i] = __fsub_rn(a[j * cols + i], hp_lane_dot(a + j * cols, 1, d, 1, i));
            __syncthreads();
        }
        if (threadIdx.x == 0)
            den = __fadd_rn(__fsqrt_rn(hp_lane_dot(a + i, cols, a + i, cols, rows)), 1e-8f);
        __syncthreads();
        for (long long j = threadIdx.x; j < rows; j += blockDim.x)
            a[j * cols + i] = __fdiv_rn(a[j * cols + i], den);
        __syncthreads();
    }
}
