// Fused CPU digest: one pass over a piece computes what agents/digest.py computes eagerly
// (fingerprint, counts, float64 moments, min/max/abs-max, CountSketch).
//
// Plain C++ without torch headers so that it builds in about a second with the machine's g++;
// agents/kernels/cpu.py loads it with ctypes and registers it as the torch op numaudit::digest.
// The hash scheme, seeds and row layout are documented in agents/digest.py and docs/digests.md;
// the constants below must stay equal to those there (tests compare both implementations).
//
// Vectorization: the per-element loop is written so that GCC's auto-vectorizer handles it
// (`omp simd` reductions, compiled with -fopenmp-simd: no OpenMP runtime). agents/kernels/build.py
// compiles this file once per ISA level (x86-64-v4 = AVX-512, v3 = AVX2, baseline) with
// NA_ISA naming the entry point, and dispatch.cpp picks one at load time by the CPU's features.
// (target_clones would clone only the entry point, not the templates it calls.)
// The sketch's scatter-add is the one part that cannot be vectorized: each block of BLOCK
// elements first writes its buckets and values to small stack arrays, then scatters into the
// 2k float64 buckets, which stay in L1 (4 KiB for k = 256).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <limits>

#ifndef NA_ISA
#define NA_ISA base
#endif
#define NA_CAT2(a, b) a##b
#define NA_CAT(a, b) NA_CAT2(a, b)

namespace {

constexpr uint64_t FINGERPRINT_SEED = 0x6E756D6175646974ULL;
constexpr uint32_t SKETCH_SEED = 0x736B3031U;
constexpr uint64_t GOLDEN_GAMMA = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t MIX_C1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t MIX_C2 = 0x94D049BB133111EBULL;
constexpr uint32_t G32_LO = 0x9E3779B9U;
constexpr uint32_t G32_HI = 0x7FEB352DU;
constexpr uint32_t FMIX32_C1 = 0x85EBCA6BU;
constexpr uint32_t FMIX32_C2 = 0xC2B2AE35U;
constexpr int N_MOMENTS = 5;
constexpr int64_t BLOCK = 512;
constexpr int MAX_DIMS = 16;
constexpr int64_t SKETCH_COPIES = 4;
constexpr int64_t SMALL_PIECE = 16384;  // elements below which the sketch has one copy

// Dtype codes: keep in step with agents/kernels/cpu.py DTYPE_CODES.
enum Dtype : int64_t {
  U8 = 0, I8 = 1, I16 = 2, I32 = 3, I64 = 4, U16 = 5, U32 = 6, U64 = 7, BOOL = 8,
  F16 = 9, BF16 = 10, F32 = 11, F64 = 12,
};

inline uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= MIX_C1;
  z ^= z >> 27;
  z *= MIX_C2;
  return z ^ (z >> 31);
}

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= FMIX32_C1;
  h ^= h >> 13;
  h *= FMIX32_C2;
  return h ^ (h >> 16);
}

// __builtin_bit_cast, not memcpy: GCC's vectorizer gives up on loops with memcpy temporaries.
inline float bits_to_f32(uint32_t u) { return __builtin_bit_cast(float, u); }
inline uint32_t f32_to_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
inline uint64_t f64_to_bits(double d) { return __builtin_bit_cast(uint64_t, d); }

// IEEE half -> float, exact, branch-free so that it vectorizes (F. Giesen's half_to_float).
inline float half_to_f32(uint16_t h) {
  const uint32_t shifted_exp = 0x7C00U << 13;
  uint32_t o = (uint32_t)(h & 0x7FFFU) << 13;
  const uint32_t exp = shifted_exp & o;
  o += (127U - 15U) << 23;
  const uint32_t inf_nan = o + ((128U - 16U) << 23);
  const float sub = bits_to_f32(o + (1U << 23)) - bits_to_f32(113U << 23);
  o = exp == shifted_exp ? inf_nan : (exp == 0 ? f32_to_bits(sub) : o);
  return bits_to_f32(o | ((uint32_t)(h & 0x8000U) << 16));
}

// Element access: raw bits zero-extended (floats, bool, uint64) or the value sign-/zero-extended
// (other integers), and the value as double (floats only).
template <int64_t D> struct Elem;
template <> struct Elem<F32> {
  using T = uint32_t;
  static uint64_t bits(T x) { return x; }
  static double value(T x) { return (double)bits_to_f32(x); }
};
template <> struct Elem<F64> {
  using T = uint64_t;
  static uint64_t bits(T x) { return x; }
  static double value(T x) { return __builtin_bit_cast(double, x); }
};
template <> struct Elem<BF16> {
  using T = uint16_t;
  static uint64_t bits(T x) { return x; }
  static double value(T x) { return (double)bits_to_f32((uint32_t)x << 16); }
};
template <> struct Elem<F16> {
  using T = uint16_t;
  static uint64_t bits(T x) { return x; }
  static double value(T x) { return (double)half_to_f32(x); }
};
#define INT_ELEM(CODE, TYPE)                                              \
  template <> struct Elem<CODE> {                                         \
    using T = TYPE;                                                       \
    static uint64_t bits(T x) { return (uint64_t)(int64_t)x; }            \
  };
INT_ELEM(I8, int8_t)
INT_ELEM(I16, int16_t)
INT_ELEM(I32, int32_t)
INT_ELEM(I64, int64_t)
#undef INT_ELEM
#define UINT_ELEM(CODE, TYPE)                                             \
  template <> struct Elem<CODE> {                                         \
    using T = TYPE;                                                       \
    static uint64_t bits(T x) { return (uint64_t)x; }                     \
  };
UINT_ELEM(U8, uint8_t)
UINT_ELEM(BOOL, uint8_t)
UINT_ELEM(U16, uint16_t)
UINT_ELEM(U32, uint32_t)
UINT_ELEM(U64, uint64_t)
#undef UINT_ELEM

struct Acc {
  uint64_t fp = 0;
  int64_t zeros = 0, nan = 0, posinf = 0, neginf = 0;
  double sum = 0, sum_sq = 0;
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  double* sketch2 = nullptr;  // SKETCH_COPIES x 2k buckets: sign + in [0, k), - in [k, 2k)
  int64_t k = 0;
  int64_t copies = 1;  // 1 for small pieces: zeroing and summing 4 copies costs more there
  uint32_t mask2k = 0;
};

struct Moments {
  int64_t zeros = 0, nonfinite = 0;
  double s = 0, ss = 0;
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
};

// Moments of one block of m elements, and each element's value with NaN/Inf replaced by 0
// written to vals[] for the sketch. Portable version: GCC keeps this loop scalar (measured
// 5 ns/element), hence the AVX2 version below for contiguous runs.
template <int64_t D, bool CONTIG>
inline void moments_block(const typename Elem<D>::T* xb, int64_t ts, int64_t m, double* vals,
                          Moments& r) {
  using E = Elem<D>;
  for (int64_t j = 0; j < m; ++j) {
    const double v = E::value(xb[CONTIG ? j : j * ts]);
    r.zeros += v == 0.0;
    const bool finite = (f64_to_bits(v) & 0x7FF0000000000000ULL) != 0x7FF0000000000000ULL;
    r.nonfinite += !finite;
    const double f = finite ? v : 0.0;
    r.s += f;
    r.ss += f * f;
    r.lo = finite && v < r.lo ? v : r.lo;
    r.hi = finite && v > r.hi ? v : r.hi;
    vals[j] = f;
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <int64_t D>
inline __m256d load4(const typename Elem<D>::T* p) {
  if constexpr (D == F32) {
    return _mm256_cvtps_pd(_mm_loadu_ps(reinterpret_cast<const float*>(p)));
  } else if constexpr (D == F64) {
    return _mm256_loadu_pd(reinterpret_cast<const double*>(p));
  } else if constexpr (D == BF16) {
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16)));
  } else {  // F16
    return _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
}

// AVX2 moments of a contiguous block: 4 float64 lanes; the tail goes to the portable loop.
// Sums use FMA for the squares (rounding differs from the eager path's within float64
// rounding, as the contract allows); min/max see only finite values, so they are exact.
template <int64_t D>
inline void moments_block_avx2(const typename Elem<D>::T* xb, int64_t m, double* vals,
                               Moments& r) {
  const __m256d zero = _mm256_setzero_pd();
  const __m256d inf = _mm256_set1_pd(std::numeric_limits<double>::infinity());
  const __m256d absmask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFLL));
  __m256d s0 = zero, s1 = zero, ss0 = zero, ss1 = zero;
  __m256d lo = inf, hi = _mm256_sub_pd(zero, inf), nonfinite = zero;
  __m256i zeros = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 <= m; j += 8) {
    const __m256d v0 = load4<D>(xb + j), v1 = load4<D>(xb + j + 4);
    const __m256d fin0 = _mm256_cmp_pd(_mm256_and_pd(v0, absmask), inf, _CMP_LT_OQ);
    const __m256d fin1 = _mm256_cmp_pd(_mm256_and_pd(v1, absmask), inf, _CMP_LT_OQ);
    zeros = _mm256_sub_epi64(zeros, _mm256_castpd_si256(_mm256_cmp_pd(v0, zero, _CMP_EQ_OQ)));
    zeros = _mm256_sub_epi64(zeros, _mm256_castpd_si256(_mm256_cmp_pd(v1, zero, _CMP_EQ_OQ)));
    nonfinite = _mm256_or_pd(nonfinite, _mm256_cmp_pd(fin0, zero, _CMP_EQ_UQ));
    nonfinite = _mm256_or_pd(nonfinite, _mm256_cmp_pd(fin1, zero, _CMP_EQ_UQ));
    const __m256d f0 = _mm256_and_pd(v0, fin0), f1 = _mm256_and_pd(v1, fin1);
    s0 = _mm256_add_pd(s0, f0);
    s1 = _mm256_add_pd(s1, f1);
    ss0 = _mm256_fmadd_pd(f0, f0, ss0);
    ss1 = _mm256_fmadd_pd(f1, f1, ss1);
    lo = _mm256_min_pd(lo, _mm256_blendv_pd(inf, v0, fin0));
    lo = _mm256_min_pd(lo, _mm256_blendv_pd(inf, v1, fin1));
    hi = _mm256_max_pd(hi, _mm256_blendv_pd(_mm256_sub_pd(zero, inf), v0, fin0));
    hi = _mm256_max_pd(hi, _mm256_blendv_pd(_mm256_sub_pd(zero, inf), v1, fin1));
    _mm256_storeu_pd(vals + j, f0);
    _mm256_storeu_pd(vals + j + 4, f1);
  }
  alignas(32) double l[4], h[4], a[4], q[4];
  alignas(32) int64_t z[4];
  _mm256_store_pd(a, _mm256_add_pd(s0, s1));
  _mm256_store_pd(q, _mm256_add_pd(ss0, ss1));
  _mm256_store_pd(l, lo);
  _mm256_store_pd(h, hi);
  _mm256_store_si256(reinterpret_cast<__m256i*>(z), zeros);
  for (int i = 0; i < 4; ++i) {
    r.s += a[i];
    r.ss += q[i];
    r.lo = l[i] < r.lo ? l[i] : r.lo;
    r.hi = h[i] > r.hi ? h[i] : r.hi;
    r.zeros += z[i];
  }
  r.nonfinite += _mm256_movemask_pd(nonfinite) != 0;  // a flag: the caller classifies
  moments_block<D, true>(xb + j, 1, m - j, vals + j, r);
}

// splitmix64's finalizer on 4 x 64-bit lanes. AVX2 has no 64-bit multiply: z * c mod 2**64 is
// lo(z) * lo(c) + ((hi(z) * lo(c) + lo(z) * hi(c)) << 32), three vpmuludq.
struct Mix4 {
  __m256i c1lo = _mm256_set1_epi64x((int64_t)(MIX_C1 & 0xFFFFFFFFULL));
  __m256i c1hi = _mm256_set1_epi64x((int64_t)(MIX_C1 >> 32));
  __m256i c2lo = _mm256_set1_epi64x((int64_t)(MIX_C2 & 0xFFFFFFFFULL));
  __m256i c2hi = _mm256_set1_epi64x((int64_t)(MIX_C2 >> 32));
};

inline __m256i mul64c(__m256i z, __m256i clo, __m256i chi) {
  const __m256i lo = _mm256_mul_epu32(z, clo);
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(z, 32), clo),
                                         _mm256_mul_epu32(z, chi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

inline __m256i mix64x4(__m256i z, const Mix4& c) {
  z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 30));
  z = mul64c(z, c.c1lo, c.c1hi);
  z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 27));
  z = mul64c(z, c.c2lo, c.c2hi);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

inline __m256i fmix32x8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int32_t)FMIX32_C1));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int32_t)FMIX32_C2));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

inline uint64_t hsum64(__m256i v) {
  alignas(32) uint64_t l[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), v);
  return l[0] + l[1] + l[2] + l[3];
}

// A contiguous block of a 16- or 32-bit float type in one loop of 8 elements per step: the
// fingerprint (two 4-lane halves, keys advanced by addition), the bucket hash, and the moments
// on float32 lanes (min/max/zeros/finiteness are exact there; only the sums need float64).
// Writes buckets[] and vals[] (finite values as double) for the scatter; returns the block's
// fingerprint sum. The tail of m % 8 elements goes to the portable loops.
template <int64_t D>
inline uint64_t narrow_block_avx2(const typename Elem<D>::T* xb, int64_t m, uint64_t kb,
                                  uint64_t key_step, uint32_t hb, uint32_t h_step,
                                  uint32_t mask2k, uint32_t copy_stride, double* vals,
                                  uint32_t* buckets, Moments& r) {
  using E = Elem<D>;
  const Mix4 c;
  __m256i key0 = _mm256_set_epi64x((int64_t)(kb + 3 * key_step), (int64_t)(kb + 2 * key_step),
                                   (int64_t)(kb + key_step), (int64_t)kb);
  __m256i key1 = _mm256_add_epi64(key0, _mm256_set1_epi64x((int64_t)(4 * key_step)));
  const __m256i key_step8 = _mm256_set1_epi64x((int64_t)(8 * key_step));
  __m256i h = _mm256_add_epi32(
      _mm256_set1_epi32((int32_t)hb),
      _mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0),
                         _mm256_set1_epi32((int32_t)h_step)));
  const __m256i h_step8 = _mm256_set1_epi32((int32_t)(8 * h_step));
  const __m256i mask = _mm256_set1_epi32((int32_t)mask2k);
  const int32_t cs = (int32_t)copy_stride;
  const __m256i copy_at = _mm256_set_epi32(3 * cs, 2 * cs, cs, 0, 3 * cs, 2 * cs, cs, 0);
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 zero = _mm256_setzero_ps();
  __m256i fp0 = _mm256_setzero_si256(), fp1 = _mm256_setzero_si256();
  __m256i zeros = _mm256_setzero_si256();
  __m256 lo = inf, hi = ninf, allfinite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  __m256d s0 = _mm256_setzero_pd(), s1 = s0, ss0 = s0, ss1 = s0;
  int64_t j = 0;
  for (; j + 8 <= m; j += 8) {
    __m256i b0, b1;
    __m256 v;
    if constexpr (D == F32) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + j));
      b0 = _mm256_cvtepu32_epi64(_mm256_castsi256_si128(raw));
      b1 = _mm256_cvtepu32_epi64(_mm256_extracti128_si256(raw, 1));
      v = _mm256_castsi256_ps(raw);
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + j));
      b0 = _mm256_cvtepu16_epi64(raw);
      b1 = _mm256_cvtepu16_epi64(_mm_srli_si128(raw, 8));
      if constexpr (D == BF16)
        v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
      else
        v = _mm256_cvtph_ps(raw);
    }
    fp0 = _mm256_add_epi64(fp0, mix64x4(_mm256_xor_si256(key0, b0), c));
    fp1 = _mm256_add_epi64(fp1, mix64x4(_mm256_xor_si256(key1, b1), c));
    key0 = _mm256_add_epi64(key0, key_step8);
    key1 = _mm256_add_epi64(key1, key_step8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buckets + j),
                        _mm256_add_epi32(_mm256_and_si256(fmix32x8(h), mask), copy_at));
    h = _mm256_add_epi32(h, h_step8);
    const __m256 fin = _mm256_cmp_ps(_mm256_and_ps(v, absmask), inf, _CMP_LT_OQ);
    allfinite = _mm256_and_ps(allfinite, fin);
    zeros = _mm256_sub_epi32(zeros, _mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_EQ_OQ)));
    lo = _mm256_min_ps(lo, _mm256_blendv_ps(inf, v, fin));
    hi = _mm256_max_ps(hi, _mm256_blendv_ps(ninf, v, fin));
    const __m256 f = _mm256_and_ps(v, fin);
    const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
    s0 = _mm256_add_pd(s0, d0);
    s1 = _mm256_add_pd(s1, d1);
    ss0 = _mm256_fmadd_pd(d0, d0, ss0);
    ss1 = _mm256_fmadd_pd(d1, d1, ss1);
    _mm256_storeu_pd(vals + j, d0);
    _mm256_storeu_pd(vals + j + 4, d1);
  }
  uint64_t fp = hsum64(_mm256_add_epi64(fp0, fp1));
  alignas(32) float l[8], u[8];
  alignas(32) int32_t z[8];
  alignas(32) double a[4], q[4];
  _mm256_store_ps(l, lo);
  _mm256_store_ps(u, hi);
  _mm256_store_si256(reinterpret_cast<__m256i*>(z), zeros);
  _mm256_store_pd(a, _mm256_add_pd(s0, s1));
  _mm256_store_pd(q, _mm256_add_pd(ss0, ss1));
  for (int i = 0; i < 8; ++i) {
    r.lo = l[i] < r.lo ? l[i] : r.lo;
    r.hi = u[i] > r.hi ? u[i] : r.hi;
    r.zeros += z[i];
  }
  r.s += (a[0] + a[1]) + (a[2] + a[3]);
  r.ss += (q[0] + q[1]) + (q[2] + q[3]);
  r.nonfinite += _mm256_movemask_ps(allfinite) != 0xFF;  // a flag: the caller classifies
  uint64_t key = kb + (uint64_t)j * key_step;
  for (int64_t t = j; t < m; ++t, key += key_step) {
    fp += mix64(key ^ E::bits(xb[t]));
    buckets[t] = (fmix32(hb + (uint32_t)t * h_step) & mask2k) + (uint32_t)(t & 3) * copy_stride;
  }
  moments_block<D, true>(xb + j, 1, m - j, vals + j, r);
  return fp;
}
#endif

// One run of n elements at x[j * ts], global flat indices g0 + j * gs, all with the same
// high 32 bits (the caller splits runs there), so the sketch's hash input is an affine
// function of j modulo 2**32 and the fingerprint key one of j modulo 2**64.
template <int64_t D, bool CONTIG>
void float_run(const typename Elem<D>::T* x, int64_t ts, int64_t n, uint64_t key0,
               uint64_t key_step, uint32_t h0, uint32_t h_step, Acc& a) {
  using E = Elem<D>;
  alignas(64) double vals[BLOCK];
  alignas(64) uint32_t buckets[BLOCK];
  const double inf = std::numeric_limits<double>::infinity();
  const uint32_t copy_stride = a.copies == SKETCH_COPIES ? (uint32_t)(2 * a.k) : 0;
  for (int64_t b = 0; b < n; b += BLOCK) {
    const int64_t m = n - b < BLOCK ? n - b : BLOCK;
    const typename E::T* xb = x + (CONTIG ? b : b * ts);
    const uint64_t kb = key0 + (uint64_t)b * key_step;
    const uint32_t hb = h0 + (uint32_t)b * h_step;
    uint64_t fp = 0;
    const uint32_t mask2k = a.mask2k;
    Moments r;
    // Element j adds into copy j % 4 of the sketch (one copy for small pieces): the copy's
    // offset is folded into buckets[j], so the scatter is one load-add-store per element.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if constexpr (CONTIG && D != F64) {
      fp = narrow_block_avx2<D>(xb, m, kb, key_step, hb, h_step, mask2k, copy_stride, vals,
                                buckets, r);
    } else
#endif
    {
      // Separate loops over the block (in L1 after the first): GCC vectorizes loops of one
      // lane width well and loops mixing 64-bit integers, doubles and 32-bit lanes badly.
      // The key is an induction variable: written as kb + j * key_step, GCC vectorizes a
      // 64-bit multiply per element (three vpmuludq on AVX2) instead of an add.
      uint64_t key = kb;
#pragma omp simd reduction(+ : fp)
      for (int64_t j = 0; j < m; ++j) {
        fp += mix64(key ^ E::bits(xb[CONTIG ? j : j * ts]));
        key += key_step;
      }
#pragma omp simd
      for (int64_t j = 0; j < m; ++j)
        buckets[j] = (fmix32(hb + (uint32_t)j * h_step) & mask2k) + (uint32_t)(j & 3) * copy_stride;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
      if (CONTIG)
        moments_block_avx2<D>(xb, m, vals, r);
      else
#endif
        moments_block<D, CONTIG>(xb, ts, m, vals, r);
    }
    a.fp += fp;
    a.zeros += r.zeros;
    a.sum += r.s;
    a.sum_sq += r.ss;
    a.lo = r.lo < a.lo ? r.lo : a.lo;
    a.hi = r.hi > a.hi ? r.hi : a.hi;
    if (r.nonfinite) {  // rare: classify the non-finite elements of this block
      for (int64_t j = 0; j < m; ++j) {
        const double v = E::value(xb[CONTIG ? j : j * ts]);
        a.nan += std::isnan(v);
        a.posinf += v == inf;
        a.neginf += v == -inf;
      }
    }
    // SKETCH_COPIES interleaved copies of the buckets: consecutive adds that hit one bucket
    // would otherwise wait on each other's store; all copies together stay in L1.
    double* sk = a.sketch2;
    int64_t j = 0;
    for (; j + 4 <= m; j += 4) {
      sk[buckets[j]] += vals[j];
      sk[buckets[j + 1]] += vals[j + 1];
      sk[buckets[j + 2]] += vals[j + 2];
      sk[buckets[j + 3]] += vals[j + 3];
    }
    for (; j < m; ++j) sk[buckets[j]] += vals[j];
  }
}

template <int64_t D, bool CONTIG>
void int_run(const typename Elem<D>::T* x, int64_t ts, int64_t n, uint64_t key0,
             uint64_t key_step, Acc& a) {
  using E = Elem<D>;
  uint64_t fp = 0;
  int64_t zeros = 0;
  uint64_t key = key0;  // an induction variable: see float_run
#pragma omp simd reduction(+ : fp, zeros)
  for (int64_t j = 0; j < n; ++j) {
    const typename E::T raw = x[CONTIG ? j : j * ts];
    fp += mix64(key ^ E::bits(raw));
    zeros += raw == 0;
    key += key_step;
  }
  a.fp += fp;
  a.zeros += zeros;
}

template <int64_t D>
void run(const void* p, int64_t ts, int64_t n, uint64_t g0, uint64_t gs, Acc& a) {
  using T = typename Elem<D>::T;
  const T* x = static_cast<const T*>(p);
  const uint64_t key0 = FINGERPRINT_SEED + GOLDEN_GAMMA * g0;
  const uint64_t key_step = GOLDEN_GAMMA * gs;
  constexpr bool is_float = D == F16 || D == BF16 || D == F32 || D == F64;
  if constexpr (is_float) {
    const uint32_t h0 = SKETCH_SEED + G32_LO * (uint32_t)g0 + G32_HI * (uint32_t)(g0 >> 32);
    const uint32_t h_step = G32_LO * (uint32_t)gs;
    if (ts == 1)
      float_run<D, true>(x, ts, n, key0, key_step, h0, h_step, a);
    else
      float_run<D, false>(x, ts, n, key0, key_step, h0, h_step, a);
  } else {
    if (ts == 1)
      int_run<D, true>(x, ts, n, key0, key_step, a);
    else
      int_run<D, false>(x, ts, n, key0, key_step, a);
  }
}

using RunFn = void (*)(const void*, int64_t, int64_t, uint64_t, uint64_t, Acc&);

RunFn run_for(int64_t dtype) {
  switch (dtype) {
    case U8: return run<U8>;
    case I8: return run<I8>;
    case I16: return run<I16>;
    case I32: return run<I32>;
    case I64: return run<I64>;
    case U16: return run<U16>;
    case U32: return run<U32>;
    case U64: return run<U64>;
    case BOOL: return run<BOOL>;
    case F16: return run<F16>;
    case BF16: return run<BF16>;
    case F32: return run<F32>;
    case F64: return run<F64>;
    default: return nullptr;
  }
}

int64_t itemsize(int64_t dtype) {
  switch (dtype) {
    case U8: case I8: case BOOL: return 1;
    case I16: case U16: case F16: case BF16: return 2;
    case I32: case U32: case F32: return 4;
    default: return 8;
  }
}

// Split one innermost run where the global index's high 32 bits change (the sketch hashes the
// two halves of the index separately), then hand each part to the dtype's run function.
void split_run(RunFn fn, const char* p, int64_t ts, int64_t itemsz, int64_t n, uint64_t g0,
               uint64_t gs, Acc& a) {
  while (n > 0) {
    int64_t m = n;
    if (gs > 0) {
      const uint64_t room = ((((g0 >> 32) + 1) << 32) - 1 - g0) / gs + 1;
      if ((uint64_t)m > room) m = (int64_t)room;
    }
    fn(p, ts, m, g0, gs, a);
    p += m * ts * itemsz;
    g0 += (uint64_t)m * gs;
    n -= m;
  }
}

// Copy one run of n elements at p[j * ts] to dst, packed (the piece's payload bytes).
void copy_run(const char* p, int64_t ts, int64_t itemsz, int64_t n, char* dst) {
  if (ts == 1) {
    std::memcpy(dst, p, n * itemsz);
    return;
  }
  const int64_t step = ts * itemsz;
  switch (itemsz) {
    case 1: for (int64_t j = 0; j < n; ++j) dst[j] = p[j * step]; break;
    case 2: for (int64_t j = 0; j < n; ++j) std::memcpy(dst + 2 * j, p + j * step, 2); break;
    case 4: for (int64_t j = 0; j < n; ++j) std::memcpy(dst + 4 * j, p + j * step, 4); break;
    default: for (int64_t j = 0; j < n; ++j) std::memcpy(dst + 8 * j, p + j * step, 8); break;
  }
}

// Digest one piece described by `desc`: [data, dtype, ndim, gbase, payload, (size, tstride,
// gstride) x ndim], strides in elements, dims outermost first. `payload`, when not 0, is where
// the piece's elements are also copied to, packed in C order (the bytes of a contiguous copy).
// Returns the number of int64s consumed, or -1 for a bad descriptor (the row is then left
// untouched).
int64_t digest_one(const int64_t* desc, int64_t k, double* f64, int64_t* i64,
                   double* sketch2) {
  const char* data = reinterpret_cast<const char*>(desc[0]);
  const int64_t dtype = desc[1];
  const int64_t ndim_in = desc[2];
  const uint64_t gbase = (uint64_t)desc[3];
  char* payload = reinterpret_cast<char*>(desc[4]);
  constexpr int64_t HEAD = 5;
  const int64_t used = HEAD + 3 * ndim_in;
  const RunFn fn = run_for(dtype);
  if (!fn || ndim_in < 0 || ndim_in > MAX_DIMS) return -1;
  // Merge dims that are contiguous in both the tensor and the logical tensor; drop size 1.
  int64_t size[MAX_DIMS], ts[MAX_DIMS], gs[MAX_DIMS];
  int64_t nd = 0, numel = 1;
  for (int64_t d = 0; d < ndim_in; ++d) {
    const int64_t s = desc[HEAD + 3 * d], t = desc[HEAD + 1 + 3 * d], g = desc[HEAD + 2 + 3 * d];
    numel *= s;
    if (s == 1) continue;
    if (nd && ts[nd - 1] == s * t && gs[nd - 1] == s * g) {
      size[nd - 1] *= s;
      ts[nd - 1] = t;
      gs[nd - 1] = g;
    } else {
      size[nd] = s, ts[nd] = t, gs[nd] = g;
      ++nd;
    }
  }
  const bool moments = dtype >= F16;
  const double inf = std::numeric_limits<double>::infinity();
  Acc a;
  if (moments) {
    a.copies = numel >= SMALL_PIECE ? SKETCH_COPIES : 1;
    std::memset(sketch2, 0, sizeof(double) * a.copies * 2 * k);
    a.sketch2 = sketch2;
    a.k = k;
    a.mask2k = (uint32_t)(2 * k - 1);
  }
  if (numel > 0) {
    const int64_t itemsz = itemsize(dtype);
    if (nd == 0) {  // one element
      split_run(fn, data, 1, itemsz, 1, gbase, 1, a);
      if (payload) std::memcpy(payload, data, itemsz);
    } else {
      // Odometer over the outer dims; the innermost dim is one run.
      int64_t coord[MAX_DIMS] = {0};
      const int64_t inner = nd - 1;
      for (;;) {
        int64_t off = 0;
        uint64_t g = gbase;
        for (int64_t d = 0; d < inner; ++d) {
          off += coord[d] * ts[d];
          g += (uint64_t)coord[d] * (uint64_t)gs[d];
        }
        split_run(fn, data + off * itemsz, ts[inner], itemsz, size[inner], g,
                  (uint64_t)gs[inner], a);
        if (payload) {
          copy_run(data + off * itemsz, ts[inner], itemsz, size[inner], payload);
          payload += size[inner] * itemsz;
        }
        int64_t d = inner - 1;
        while (d >= 0 && ++coord[d] == size[d]) coord[d--] = 0;
        if (d < 0) break;
      }
    }
  }
  f64[0] = moments ? a.sum : 0.0;
  f64[1] = moments ? a.sum_sq : 0.0;
  f64[2] = moments ? a.lo : inf;
  f64[3] = moments ? a.hi : -inf;
  f64[4] = moments && a.lo <= a.hi ? std::fmax(std::fabs(a.lo), std::fabs(a.hi)) : 0.0;
  for (int64_t b = 0; b < k; ++b) {
    double v = 0.0;
    if (moments) {
      const double* sk = a.sketch2;
      if (a.copies == 1) {
        v = sk[b] - sk[k + b];
      } else {
        const double pos = (sk[b] + sk[2 * k + b]) + (sk[4 * k + b] + sk[6 * k + b]);
        const double neg = (sk[k + b] + sk[3 * k + b]) + (sk[5 * k + b] + sk[7 * k + b]);
        v = pos - neg;
      }
    }
    f64[N_MOMENTS + b] = v;
  }
  i64[0] = numel;
  i64[1] = a.nan;
  i64[2] = a.posinf;
  i64[3] = a.neginf;
  i64[4] = a.zeros;
  i64[5] = (int64_t)a.fp;
  return used;
}

}  // namespace

extern "C" {

// Digest `n` pieces described back to back in `desc` (see digest_one) into rows of f64
// [n, 5 + k] and i64 [n, 6]. Returns 0, 1 + the index of the first bad descriptor, or -1
// when the sketch's buffer cannot be allocated.
int64_t NA_CAT(numaudit_digest_batch_, NA_ISA)(int64_t n, const int64_t* desc, int64_t k,
                                              double* f64, int64_t* i64) {
  // No std:: containers anywhere in this file: their out-of-line template code is shared
  // between the per-ISA objects at link time, so AVX-512 code could run on an AVX2 CPU.
  thread_local double* sketch2 = nullptr;
  thread_local int64_t sketch2_k = 0;
  if (sketch2_k < k) {
    double* grown = static_cast<double*>(
        std::realloc(sketch2, sizeof(double) * SKETCH_COPIES * 2 * k));
    if (!grown) return -1;
    sketch2 = grown;
    sketch2_k = k;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t used = digest_one(desc, k, f64 + i * (N_MOMENTS + k), i64 + i * 6, sketch2);
    if (used < 0) return i + 1;
    desc += used;
  }
  return 0;
}

}  // extern "C"
