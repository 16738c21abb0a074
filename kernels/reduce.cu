// hoplite_gpu reduction kernels, compiled lazily by CuPy (RawModule + name_expressions) and cached
// per device by hoplite_gpu/gpu.py. One templated family covers every (op, dtype) pair:
//
//   hoplite_reduce<T, Op>(acc, other, n)   acc[i] = Op(acc[i], other[i])      (in place)
//   hoplite_average<T>(acc, n, count)      acc[i] = acc[i] / count            (ReduceOp.AVG)
//
// T is the storage type: __half, hoplite_bf16, float, double, int, long long, unsigned char.
// 16-bit floats are computed in float and rounded back (round to nearest even), as NumPy and
// ml_dtypes do per operation. MIN and MAX propagate NaN like numpy.minimum / numpy.maximum.
// Integer AVG truncates toward zero, like the host path (and NCCL).

#include <cuda_fp16.h>

// Every kernel walks its n elements with a grid-stride loop (any grid size covers any n).
#define HOPLITE_GRID_STRIDE(i, n)                                                                         \
    for (unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x; \
         i < (n); i += static_cast<unsigned long long>(gridDim.x) * blockDim.x)

struct hoplite_bf16 {
    unsigned short bits;
};

template <typename T>
struct HopliteNum {
    typedef T calc;
    __device__ static T load(T x) { return x; }
    __device__ static T store(T x) { return x; }
};

template <>
struct HopliteNum<__half> {
    typedef float calc;
    __device__ static float load(__half x) { return __half2float(x); }
    __device__ static __half store(float x) { return __float2half_rn(x); }
};

template <>
struct HopliteNum<hoplite_bf16> {
    typedef float calc;
    __device__ static float load(hoplite_bf16 x) {
        return __uint_as_float(static_cast<unsigned int>(x.bits) << 16);
    }
    __device__ static hoplite_bf16 store(float x) {
        unsigned int u = __float_as_uint(x);
        hoplite_bf16 out;
        if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN
            out.bits = static_cast<unsigned short>((u >> 16) | 0x40u);
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
            out.bits = static_cast<unsigned short>(u >> 16);
        }
        return out;
    }
};

struct OpSum {
    template <typename C>
    __device__ static C apply(C a, C b) { return a + b; }
};

struct OpProd {
    template <typename C>
    __device__ static C apply(C a, C b) { return a * b; }
};

struct OpMin {
    template <typename C>
    __device__ static C apply(C a, C b) { return (a < b || a != a) ? a : b; }
};

struct OpMax {
    template <typename C>
    __device__ static C apply(C a, C b) { return (a > b || a != a) ? a : b; }
};

template <typename T, typename Op>
__global__ void hoplite_reduce(T* __restrict__ acc, const T* __restrict__ other, unsigned long long n) {
    typedef HopliteNum<T> N;
    HOPLITE_GRID_STRIDE(i, n) {
        acc[i] = N::store(Op::apply(N::load(acc[i]), N::load(other[i])));
    }
}

template <typename T>
__global__ void hoplite_average(T* __restrict__ acc, unsigned long long n, double count) {
    typedef HopliteNum<T> N;
    typedef typename N::calc C;
    HOPLITE_GRID_STRIDE(i, n) {
        acc[i] = N::store(static_cast<C>(static_cast<double>(N::load(acc[i])) / count));
    }
}

// Weighted SUM (float dtypes): hoplite_scale<T>(acc, n, w) sets acc[i] = w * acc[i];
// hoplite_axpy<T>(acc, other, n, w) sets acc[i] = acc[i] + w * other[i]. Computed in float (double
// for double) and rounded once per step, like the host path's per-operation rounding for 16-bit floats.
template <typename T>
__global__ void hoplite_scale(T* __restrict__ acc, unsigned long long n, double w) {
    typedef HopliteNum<T> N;
    typedef typename N::calc C;
    const C cw = static_cast<C>(w);
    HOPLITE_GRID_STRIDE(i, n) {
        acc[i] = N::store(static_cast<C>(N::load(acc[i]) * cw));
    }
}

template <typename T>
__global__ void hoplite_axpy(T* __restrict__ acc, const T* __restrict__ other, unsigned long long n, double w) {
    typedef HopliteNum<T> N;
    typedef typename N::calc C;
    const C cw = static_cast<C>(w);
    HOPLITE_GRID_STRIDE(i, n) {
        acc[i] = N::store(static_cast<C>(N::load(acc[i]) + static_cast<C>(N::load(other[i]) * cw)));
    }
}
