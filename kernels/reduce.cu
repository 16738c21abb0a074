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

// Every kernel below goes through hoplite_each: where both arrays start on a 16-byte boundary (the
// store's chunks do), each thread moves 16 bytes per load and store (8 bfloat16 or half, 4 float,
// 2 double), and the n % (16 / sizeof(T)) elements left over, or misaligned arrays, go one by one.
// Loads of 2-byte elements one by one kept the bfloat16 SUM at 0.56x of the H100's copy bandwidth
// where float32 reached 0.87x (bench/gpu.py, 2026-11-24).
struct alignas(16) hoplite_vec16 {
    unsigned int w[4];
};

template <typename T, typename F>
__device__ void hoplite_each(T* acc, const T* other, unsigned long long n, F f) {
    const unsigned long long per = sizeof(hoplite_vec16) / sizeof(T);
    unsigned long long head = 0;
    const unsigned long long misaligned =
        reinterpret_cast<unsigned long long>(acc) | reinterpret_cast<unsigned long long>(other);
    if (per > 1 && misaligned % sizeof(hoplite_vec16) == 0) {
        const unsigned long long blocks = n / per;
        hoplite_vec16* a = reinterpret_cast<hoplite_vec16*>(acc);
        const hoplite_vec16* b = reinterpret_cast<const hoplite_vec16*>(other);
        HOPLITE_GRID_STRIDE(j, blocks) {
            hoplite_vec16 va = a[j];
            const hoplite_vec16 vb = b[j];
            T* ea = reinterpret_cast<T*>(&va);
            const T* eb = reinterpret_cast<const T*>(&vb);
#pragma unroll
            for (unsigned int k = 0; k < sizeof(hoplite_vec16) / sizeof(T); ++k) {
                ea[k] = f(ea[k], eb[k]);
            }
            a[j] = va;
        }
        head = blocks * per;
    }
    HOPLITE_GRID_STRIDE(i, n - head) {
        acc[head + i] = f(acc[head + i], other[head + i]);
    }
}

template <typename T, typename Op>
struct HopliteReduceF {
    __device__ T operator()(T a, T b) const {
        typedef HopliteNum<T> N;
        return N::store(Op::apply(N::load(a), N::load(b)));
    }
};

template <typename T>
struct HopliteAverageF {
    double count;
    __device__ T operator()(T a, T) const {
        typedef HopliteNum<T> N;
        typedef typename N::calc C;
        return N::store(static_cast<C>(static_cast<double>(N::load(a)) / count));
    }
};

template <typename T>
struct HopliteScaleF {
    typename HopliteNum<T>::calc w;
    __device__ T operator()(T a, T) const {
        typedef HopliteNum<T> N;
        typedef typename N::calc C;
        return N::store(static_cast<C>(N::load(a) * w));
    }
};

template <typename T>
struct HopliteAxpyF {
    typename HopliteNum<T>::calc w;
    __device__ T operator()(T a, T b) const {
        typedef HopliteNum<T> N;
        typedef typename N::calc C;
        return N::store(static_cast<C>(N::load(a) + static_cast<C>(N::load(b) * w)));
    }
};

template <typename T, typename Op>
__global__ void hoplite_reduce(T* __restrict__ acc, const T* __restrict__ other, unsigned long long n) {
    hoplite_each(acc, other, n, HopliteReduceF<T, Op>());
}

template <typename T>
__global__ void hoplite_average(T* __restrict__ acc, unsigned long long n, double count) {
    HopliteAverageF<T> f;
    f.count = count;
    hoplite_each(acc, static_cast<const T*>(acc), n, f);
}

// Weighted SUM (float dtypes): hoplite_scale<T>(acc, n, w) sets acc[i] = w * acc[i];
// hoplite_axpy<T>(acc, other, n, w) sets acc[i] = acc[i] + w * other[i]. Computed in float (double
// for double) and rounded once per step, like the host path's per-operation rounding for 16-bit floats.
template <typename T>
__global__ void hoplite_scale(T* __restrict__ acc, unsigned long long n, double w) {
    HopliteScaleF<T> f;
    f.w = static_cast<typename HopliteNum<T>::calc>(w);
    hoplite_each(acc, static_cast<const T*>(acc), n, f);
}

template <typename T>
__global__ void hoplite_axpy(T* __restrict__ acc, const T* __restrict__ other, unsigned long long n, double w) {
    HopliteAxpyF<T> f;
    f.w = static_cast<typename HopliteNum<T>::calc>(w);
    hoplite_each(acc, other, n, f);
}
