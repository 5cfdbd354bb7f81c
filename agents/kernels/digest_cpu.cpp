// Fused CPU digest: one pass over a piece computes what agents/digest.py computes eagerly
// (fingerprint, counts, float64 moments, min/max/abs-max, CountSketch) with the version-3 hash
// scheme of wire/hashing.py.
//
// Plain C++ without torch headers so that it builds in about a second with the machine's g++;
// agents/kernels/cpu.py loads it with ctypes and registers it as the torch op numaudit::digest.
// The scheme and its constants are defined in wire/hashing.py and docs/digests.md; the
// constants below must stay equal to those (tests compare every implementation).
//
// The scheme is built for this loop: a global index i is a lane j = i mod 256 and a block
// b = i div 256. The fingerprint's key is geometric, K(i) = u * h**i = T[j] * P(b) (lane table
// T[j] = u * h**j, block power P(b) = h**(256 b), a few byte-table products per block), so a
// block's elements sum T[j] * V(x) and the block's sum is multiplied by P(b) once. V(x) is the
// raw bits of float16/bfloat16/float32 and mix64 of the 64-bit bits for every other dtype. One
// splitmix64 per block draws the sketch's word; per element only table loads, XORs and
// multiplies remain. For contiguous float32/bfloat16/float16 runs (the bulk of activations and
// gradients) an AVX2 loop takes 8 elements per step:
//   - fingerprint: lane keys T[j..j+7] times the raw bits (the key's low half by two vpmuludq
//     per 4 lanes; its high half, which counts only mod 2**32, by one vpmulld per 8 lanes,
//     summed apart), folded into one 64-bit sum per block and multiplied by P(b);
//   - moments on float32 lanes (min/max, zeros, finiteness exact there), sums in float64;
//   - sketch: a group of 8 consecutive lanes lands in 8 consecutive buckets, permuted (the
//     block's placement row), so the scatter-add of version 1 (one dependent load-add-store per
//     element) becomes one sign XOR, one vpermps and two float64 vector adds.
// Contiguous integers take a per-block loop the compiler vectorizes, contiguous float64 an
// AVX-512 loop (mix64 in vpmullq); everything else (strided global indices, tails) takes the
// scalar loop, which computes the same values element by element. Compiled once per ISA level
// (agents/kernels/build.py) and picked at load time by dispatch.cpp.

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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NA_VECTOR 1
#else
#define NA_VECTOR 0
#endif
#if NA_VECTOR && defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
#define NA_VECTOR512 1
#else
#define NA_VECTOR512 0
#endif

namespace {

constexpr uint64_t FINGERPRINT_SEED = 0x6E61763366696E67ULL;  // b"nav3fing"
constexpr uint64_t SKETCH_SEED = 0x6E6176327368656BULL;       // b"nav2shek"
constexpr uint64_t GOLDEN_GAMMA = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t MIX_C1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t MIX_C2 = 0x94D049BB133111EBULL;
constexpr int LANE_BITS = 8;
constexpr int64_t LANES = 1 << LANE_BITS;
constexpr int POW_BYTES = 7;  // bytes of a block index the power table covers (all: b < 2**56)
constexpr int GROUPS = LANES / 8;
constexpr int64_t PLACE_ROWS = 4096;
constexpr uint64_t PLACE_SEED = SKETCH_SEED ^ 0x706C616365000000ULL;  // b"place"
constexpr int N_MOMENTS = 5;
constexpr int MAX_DIMS = 16;
constexpr int64_t PREFETCH_BLOCKS = 4;

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

// The sketch's sign pattern: parity of (low nibble AND high nibble), a bent function of 8 bits.
inline uint32_t bent(uint32_t u) {
  uint32_t t = (u & 15U) & (u >> 4);
  t ^= t >> 2;
  t ^= t >> 1;
  return t & 1U;
}

struct Tables {
  alignas(64) uint64_t key[LANES];  // T[j] = u * h**j: the fingerprint key's lane part (odd)
  // pow[t][v] = H**(v << 8t), H = h**256: P(b) = h**(256 b) is the product of pow[t][byte t of
  // b] over the bytes of b (block_power).
  alignas(64) uint64_t pow[POW_BYTES][LANES];
  // key[] split by parity (even_key[m] = T[2m], odd_key[m] = T[2m + 1]): the vector loops
  // multiply the even elements of a 32-bit vector in place and the odd ones shifted down.
  alignas(64) uint64_t even_key[LANES / 2], odd_key[LANES / 2];
  // Their high halves in lane order (hi32[j] = T[j] >> 32): the key's high half enters the
  // fingerprint only mod 2**32 (shifted up by 32), so the vector loops multiply it with the
  // element bits in 32-bit lanes (one vpmulld for all lanes) instead of in the even and odd
  // 64-bit halves (two vpmuludq and the shifts or tables that line them up).
  alignas(64) uint32_t hi32[LANES];
  // sign[w & 7][q ^ (w >> 3)][r] = bent((8q + r) XOR w) << 31: the sign bits of lanes
  // 8q .. 8q + 7 for the block's sign shift w, ready to XOR into float32 lanes. A block reads
  // one contiguous 1 KiB slice (w & 7 first): in a training step, where the tables are evicted
  // between calls, its 16 lines come in as one stream instead of 16 lines 256 bytes apart.
  alignas(64) uint32_t sign[8][LANES / 8][8];
  // The same as float64 sign bits (<< 63), for the loops whose sketch adds float64 lanes.
  alignas(64) uint64_t sign64[8][LANES / 8][8];
  // place[row][q] = g | x << 5: lane group q of a block whose word selects `row` goes to bucket
  // group g with its 8 lanes permuted by r ^ x (wire/hashing.py place_table).
  alignas(64) uint8_t place[PLACE_ROWS][GROUPS];
  // Permute indices for a lane XOR x (8 lanes), as vpermps (float32) and vpermpd take them.
  alignas(64) int32_t perm8[8][8];
  alignas(64) int64_t perm8_64[8][8];  // the same as 64-bit indices (float64 lanes)
  Tables() {
    // h = 5 mod 8 (multiplicative order 2**62 mod 2**64), u odd: wire/hashing.py H_BASE, U_SCALE.
    const uint64_t h = (mix64(FINGERPRINT_SEED) & ~7ULL) | 5ULL;
    const uint64_t u = mix64(FINGERPRINT_SEED + GOLDEN_GAMMA) | 1ULL;
    key[0] = u;
    for (int64_t j = 1; j < LANES; ++j) key[j] = key[j - 1] * h;
    uint64_t step = 1;
    for (int64_t j = 0; j < LANES; ++j) step *= h;  // H = h**256
    for (int t = 0; t < POW_BYTES; ++t) {
      pow[t][0] = 1;
      for (int64_t v = 1; v < LANES; ++v) pow[t][v] = pow[t][v - 1] * step;
      step = pow[t][LANES - 1] * step;  // H**(256**(t + 1))
    }
    for (int64_t m = 0; m < LANES / 2; ++m) {
      even_key[m] = key[2 * m], odd_key[m] = key[2 * m + 1];
      hi32[2 * m] = (uint32_t)(key[2 * m] >> 32);
      hi32[2 * m + 1] = (uint32_t)(key[2 * m + 1] >> 32);
    }
    for (uint32_t qq = 0; qq < LANES / 8; ++qq)
      for (uint32_t wl = 0; wl < 8; ++wl)
        for (uint32_t r = 0; r < 8; ++r) sign[wl][qq][r] = bent(8 * qq + (r ^ wl)) << 31;
    for (uint32_t qq = 0; qq < LANES / 8; ++qq)
      for (uint32_t wl = 0; wl < 8; ++wl)
        for (uint32_t r = 0; r < 8; ++r) sign64[wl][qq][r] = (uint64_t)sign[wl][qq][r] << 32;
    uint64_t n = 0;
    for (int64_t row = 0; row < PLACE_ROWS; ++row) {
      uint8_t perm[GROUPS];
      for (int q = 0; q < GROUPS; ++q) perm[q] = (uint8_t)q;
      for (int t = GROUPS - 1; t > 0; --t) {
        const uint64_t u = mix64(PLACE_SEED + GOLDEN_GAMMA * ++n) % (uint64_t)(t + 1);
        const uint8_t tmp = perm[t];
        perm[t] = perm[u], perm[u] = tmp;
      }
      for (int q = 0; q < GROUPS; ++q)
        place[row][q] = (uint8_t)(perm[q] | (mix64(PLACE_SEED + GOLDEN_GAMMA * ++n) & 7) << 5);
    }
    for (int x = 0; x < 8; ++x)
      for (int r = 0; r < 8; ++r) perm8[x][r] = perm8_64[x][r] = r ^ x;
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

// P(b) = h**(256 b), the fingerprint key's block part (odd): one table entry per byte of b up
// to its highest non-zero one (indices below 2**32: at most three entries, two multiplies).
inline uint64_t block_power(uint64_t b) {
  const Tables& tb = tables();
  uint64_t p = tb.pow[0][b & (LANES - 1)];
  for (int t = 1; t < POW_BYTES && (b >>= LANE_BITS) != 0; ++t) p *= tb.pow[t][b & (LANES - 1)];
  return p;
}

// Block b's fingerprint power P(b) and the sketch's random word W(b) (bucket offset for k > 256
// in its low bits, sign shift in bits 32..39, placement row in bits 40..51, block sign in bit 63).
struct Block {
  uint64_t power, word;
  explicit Block(uint64_t b) : power(block_power(b)), word(sketch_word(b)) {}
  static uint64_t sketch_word(uint64_t b) { return mix64(SKETCH_SEED + GOLDEN_GAMMA * b); }
};

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

// V(x), the fingerprint's value term: the raw bits of float16/bfloat16/float32 (below 2**32),
// mix64 of the 64-bit bits for float64, integers and bool (wire/hashing.py value_term). The
// mix keeps a geometric key from cancelling a change of a high power of two repeated over a
// power-of-two count of elements.
template <int64_t D>
constexpr bool MIXED = !(D == F16 || D == BF16 || D == F32);
template <int64_t D>
inline uint64_t value_term(typename Elem<D>::T x) {
  if constexpr (MIXED<D>)
    return mix64(Elem<D>::bits(x));
  else
    return Elem<D>::bits(x);
}

// One block's share of a contiguous run at global indices gb, gb + 1, ...: where it starts in
// the block, how many of the `left` elements it holds, and the block's power and word as the
// vector loops use them.
struct Segment {
  uint64_t start;  // the global index of its first element
  int64_t j0, len;
  uint64_t power, word;  // P(b): the segment's sum of T[j] * V(x) is multiplied by it
  const uint8_t* place;  // the block's placement row
  uint64_t high;         // bucket offset when k > 256
  uint32_t shift;        // the sign pattern's shift
  Segment(uint64_t gb, int64_t left, uint64_t kmask) : start(gb) {
    j0 = (int64_t)(gb & (LANES - 1));
    len = LANES - j0 < left ? LANES - j0 : left;
    const Block blk(gb >> LANE_BITS);
    power = blk.power, word = blk.word;
    place = tables().place[(word >> 40) & (PLACE_ROWS - 1)];
    high = word & kmask & ~(uint64_t)(LANES - 1);
    shift = (uint32_t)(word >> 32) & (LANES - 1);
  }
  uint32_t negative() const { return (uint32_t)(word >> 63); }
  // Start loading the placement row of the block PREFETCH_BLOCKS ahead while this block runs:
  // in a training step the 128 KiB table is out of cache at every call, and the row decides
  // where the block's sketch adds go. One block ahead (about 100 ns of work) did not hide a
  // miss on a large piece, whose stream evicts the table from L2; four did (2-5 % on 16 MiB).
  void prefetch_next(int64_t left) const {
#if NA_VECTOR
    if (left > len + (PREFETCH_BLOCKS - 1) * LANES) {
      const uint64_t w = Block::sketch_word((start >> LANE_BITS) + PREFETCH_BLOCKS);
      _mm_prefetch(reinterpret_cast<const char*>(tables().place[(w >> 40) & (PLACE_ROWS - 1)]),
                   _MM_HINT_T0);
    }
#else
    (void)left;
#endif
  }
};

struct Acc {
  uint64_t fp = 0;
  int64_t zeros = 0, nan = 0, posinf = 0, neginf = 0;
  double sum = 0, sum_sq = 0;
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  double* sketch = nullptr;  // k signed buckets
  int64_t k = 0;
  // The AVX2 loop may take its unmasked form, which assumes every element is finite; it sets
  // `redo` when its float64 sums say otherwise, and digest_one digests the piece again with
  // `assume_finite` off (the masked form), so NaN/Inf cost a second pass and nothing else.
  bool assume_finite = false;
  bool redo = false;
};

// One float value of lane j in a block with sketch word w: moments, counts, sketch.
inline void add_value(double v, uint32_t j, uint64_t w, Acc& a) {
  a.zeros += v == 0.0;
  if (std::isfinite(v)) {
    a.sum += v;
    a.sum_sq += v * v;
    a.lo = v < a.lo ? v : a.lo;
    a.hi = v > a.hi ? v : a.hi;
    const uint32_t e = tables().place[(w >> 40) & (PLACE_ROWS - 1)][j >> 3];
    const uint64_t bucket =
        ((8 * (e & 31) + ((j & 7) ^ (e >> 5))) ^ (w & (uint64_t)(a.k - 1) & ~(uint64_t)(LANES - 1))) &
        (uint64_t)(a.k - 1);
    const uint32_t minus = bent((j ^ (uint32_t)(w >> 32)) & (LANES - 1)) ^ (uint32_t)(w >> 63);
    a.sketch[bucket] += minus ? -v : v;
  } else {
    a.nan += std::isnan(v);
    a.posinf += v > 0;
    a.neginf += v < 0;
  }
}

// Element by element: any dtype, tensor stride ts, global indices g, g + gs, ... The elements
// of one block sum T[j] * V(x) in `seg`, multiplied by the block's power when the block changes.
template <int64_t D>
void scalar_run(const typename Elem<D>::T* x, int64_t ts, int64_t n, uint64_t g, uint64_t gs,
                Acc& a) {
  using E = Elem<D>;
  constexpr bool is_float = D == F16 || D == BF16 || D == F32 || D == F64;
  const Tables& tb = tables();
  uint64_t current = ~0ULL, power = 0, word = 0;
  uint64_t fp = 0, seg = 0;
  for (int64_t t = 0; t < n; ++t, g += gs) {
    const uint64_t b = g >> LANE_BITS;
    if (b != current) {
      fp += seg * power;
      seg = 0;
      const Block blk(b);
      power = blk.power, word = blk.word, current = b;
    }
    const uint32_t j = (uint32_t)(g & (LANES - 1));
    const typename E::T raw = x[t * ts];
    seg += tb.key[j] * value_term<D>(raw);
    if constexpr (is_float)
      add_value(E::value(raw), j, word, a);
    else
      a.zeros += raw == 0;
  }
  a.fp += fp + seg * power;
}

// Integers and bool at consecutive global indices: per block, a loop the compiler vectorizes
// (three 64-bit multiplies per element, two of them mix64's: vpmullq with AVX-512, emulated
// with AVX2), whose sum is multiplied by the block's power.
template <int64_t D, bool CONTIG>
void int_run(const typename Elem<D>::T* x, int64_t ts, int64_t n, uint64_t g, Acc& a) {
  const Tables& tb = tables();
  uint64_t fp = 0;
  int64_t zeros = 0;
  for (int64_t done = 0; done < n;) {
    const int64_t j0 = (int64_t)((g + (uint64_t)done) & (LANES - 1));
    const int64_t seg = LANES - j0 < n - done ? LANES - j0 : n - done;
    const uint64_t* lane_key = tb.key + j0;
    const typename Elem<D>::T* xb = x + done * ts;
    uint64_t sum = 0;
#pragma omp simd reduction(+ : sum, zeros)
    for (int64_t t = 0; t < seg; ++t) {
      const typename Elem<D>::T raw = xb[CONTIG ? t : t * ts];
      sum += lane_key[t] * value_term<D>(raw);
      zeros += raw == 0;
    }
    fp += sum * block_power((g + (uint64_t)done) >> LANE_BITS);
    done += seg;
  }
  a.fp += fp;
  a.zeros += zeros;
}

#if NA_VECTOR
inline uint64_t hsum64(__m256i v) {
  alignas(32) uint64_t l[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), v);
  return l[0] + l[1] + l[2] + l[3];
}

// One segment's sum of T[j] * bits mod 2**64 from the narrow loops' two accumulators: `lo`
// (64-bit lanes: lo32(T) * bits) and `hi` (32-bit lanes: hi32(T) * bits mod 2**32, worth
// 2**32 each). A 64-bit lane L of `hi` holds two such sums, and
// (L << 32) + (L & ~(2**32 - 1)) = (low + high) << 32 mod 2**64 adds both into it.
inline __m256i fold_hi(__m256i lo, __m256i hi) {
  const __m256i high_half = _mm256_set1_epi64x((int64_t)0xFFFFFFFF00000000ULL);
  return _mm256_add_epi64(
      lo, _mm256_add_epi64(_mm256_slli_epi64(hi, 32), _mm256_and_si256(hi, high_half)));
}

// Rare: count the NaN/+Inf/-Inf among n elements (the vector loops only flag that some are).
template <int64_t D>
void classify_nonfinite(const typename Elem<D>::T* x, int64_t n, Acc& a) {
  for (int64_t t = 0; t < n; ++t) {
    const double v = Elem<D>::value(x[t]);
    a.nan += std::isnan(v);
    a.posinf += v == std::numeric_limits<double>::infinity();
    a.neginf += v == -std::numeric_limits<double>::infinity();
  }
}

// n (a multiple of 8) contiguous float32/bfloat16/float16 elements at global indices g, g + 1,
// ... with g a multiple of 8, and a sketch of k >= 8 buckets.
//
// FINITE (Acc::assume_finite, the first pass over every piece) drops the finiteness mask and
// its blends: min, max, the sums and the sketch take every lane as it is. A NaN or infinity
// anywhere then leaves a float64 sum non-finite (finite 16- and 32-bit floats cannot overflow
// one), which sets `a.redo`, and digest_one digests the piece again with FINITE off. On a CPU
// that splits 256-bit operations in two (AMD Zen 1) the mask was a fifth of the loop's time
// (float32 1.55 -> 1.18 ns an element); finite pieces get bitwise the same rows either way.
template <int64_t D, bool FINITE>
void narrow_body(const typename Elem<D>::T* x, int64_t n, uint64_t g, Acc& a) {
  using E = Elem<D>;
  const Tables& tb = tables();
  const uint64_t kmask = (uint64_t)a.k - 1;
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 zero = _mm256_setzero_ps();
  uint64_t fp = 0;
  __m256 lo = inf, hi = ninf;
  __m256d s0 = _mm256_setzero_pd(), s1 = s0, ss0 = s0, ss1 = s0;
  for (int64_t done = 0; done < n;) {
    const Segment sg(g + (uint64_t)done, n - done, kmask);
    sg.prefetch_next(n - done);
    const int64_t j0 = sg.j0, seg = sg.len;
    // This block's sum of T[j] * bits: lo32(T) * bits in 64-bit lanes, hi32(T) * bits in 32-bit
    // lanes (it counts only mod 2**32), folded into one 64-bit sum times P(b) after the block.
    __m256i fp_lo = _mm256_setzero_si256(), fp_hi = _mm256_setzero_si256();
    const uint32_t* signs = &tb.sign[sg.shift & 7][0][0];
    const uint32_t shift_hi = sg.shift >> 3;
    const __m256i flip = _mm256_set1_epi32((int32_t)(sg.negative() << 31));
    const typename E::T* xb = x + done;
    __m256 allfinite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    __m256i zeros = _mm256_setzero_si256();
    for (int64_t t = 0; t < seg; t += 8) {
      const uint32_t q = (uint32_t)((j0 + t) >> 3);
      __m256i bits;  // 8 x 32-bit raw bits (16-bit types zero-extended)
      __m256 v;
      if constexpr (D == F32) {
        bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + t));
        v = _mm256_castsi256_ps(bits);
      } else {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + t));
        bits = _mm256_cvtepu16_epi32(raw);
        if constexpr (D == BF16)
          v = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
        else
          v = _mm256_cvtph_ps(raw);
      }
      // Fingerprint: T[j] * bits mod 2**64 = lo32(T) * bits + (hi32(T) * bits mod 2**32) << 32;
      // for the low half even elements sit in the low halves of the 64-bit lanes, odd ones are
      // shifted there; the high half's products are summed mod 2**32 in 32-bit lanes.
      const int64_t m = (j0 + t) >> 1;
      const __m256i ke = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.even_key + m));
      const __m256i ko = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.odd_key + m));
      const __m256i odd = _mm256_srli_epi64(bits, 32);
      fp_lo = _mm256_add_epi64(fp_lo, _mm256_add_epi64(_mm256_mul_epu32(ke, bits),
                                                       _mm256_mul_epu32(ko, odd)));
      fp_hi = _mm256_add_epi32(
          fp_hi, _mm256_mullo_epi32(
                     _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.hi32 + j0 + t)), bits));
      // Moments over the finite lanes (FINITE: over all of them).
      zeros = _mm256_sub_epi32(zeros, _mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_EQ_OQ)));
      __m256 f = v;
      if constexpr (FINITE) {
        lo = _mm256_min_ps(v, lo);
        hi = _mm256_max_ps(v, hi);
      } else {
        const __m256 fin = _mm256_cmp_ps(_mm256_and_ps(v, absmask), inf, _CMP_LT_OQ);
        allfinite = _mm256_and_ps(allfinite, fin);
        lo = _mm256_min_ps(lo, _mm256_blendv_ps(inf, v, fin));
        hi = _mm256_max_ps(hi, _mm256_blendv_ps(ninf, v, fin));
        f = _mm256_and_ps(v, fin);
      }
      const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
      const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
      s0 = _mm256_add_pd(s0, d0);
      s1 = _mm256_add_pd(s1, d1);
      ss0 = _mm256_fmadd_pd(d0, d0, ss0);
      ss1 = _mm256_fmadd_pd(d1, d1, ss1);
      // Sketch: signs, then lane r goes to slot r ^ x of bucket group g (the block's placement).
      const __m256i sm = _mm256_xor_si256(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(signs + 8 * (q ^ shift_hi))), flip);
      const uint32_t e = sg.place[q];
      const __m256 p = _mm256_permutevar8x32_ps(
          _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(f), sm)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.perm8[e >> 5])));
      double* dst = a.sketch + (((8 * (e & 31)) ^ sg.high) & kmask);
      _mm256_storeu_pd(dst, _mm256_add_pd(_mm256_loadu_pd(dst),
                                          _mm256_cvtps_pd(_mm256_castps256_ps128(p))));
      _mm256_storeu_pd(dst + 4, _mm256_add_pd(_mm256_loadu_pd(dst + 4),
                                              _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1))));
    }
    fp += hsum64(fold_hi(fp_lo, fp_hi)) * sg.power;
    alignas(32) int32_t z[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(z), zeros);
    a.zeros += (int64_t)z[0] + z[1] + z[2] + z[3] + z[4] + z[5] + z[6] + z[7];
    if (!FINITE && _mm256_movemask_ps(allfinite) != 0xFF) classify_nonfinite<D>(xb, seg, a);
    done += seg;
  }
  a.fp += fp;
  alignas(32) float l[8], u[8];
  alignas(32) double s[4], q[4];
  _mm256_store_ps(l, lo);
  _mm256_store_ps(u, hi);
  _mm256_store_pd(s, _mm256_add_pd(s0, s1));
  _mm256_store_pd(q, _mm256_add_pd(ss0, ss1));
  const double sum = (s[0] + s[1]) + (s[2] + s[3]), sum_sq = (q[0] + q[1]) + (q[2] + q[3]);
  if (FINITE && !(std::isfinite(sum) && std::isfinite(sum_sq))) {
    a.redo = true;  // some element is NaN or infinite: digest_one digests the piece masked
    return;
  }
  for (int i = 0; i < 8; ++i) {
    a.lo = l[i] < a.lo ? l[i] : a.lo;
    a.hi = u[i] > a.hi ? u[i] : a.hi;
  }
  a.sum += sum;
  a.sum_sq += sum_sq;
}

#if NA_VECTOR512
// The AVX-512 form of narrow_body: 16 elements per step (two lane groups), n a multiple of 16,
// g a multiple of 16, k >= 8. Masks replace the blends, and the sketch adds the float64 lanes
// the moments converted (sign bits XORed there, lanes permuted as float64) instead of
// converting permuted float32 lanes again: six of about forty vector operations per step,
// though the loop gained only 1-2 % from it (the sketch's dependent bucket loads and stores,
// about a third of its time, are what bound it; docs/benchmarks.md).
template <int64_t D>
void narrow_body512(const typename Elem<D>::T* x, int64_t n, uint64_t g, Acc& a) {
  using E = Elem<D>;
  const Tables& tb = tables();
  const uint64_t kmask = (uint64_t)a.k - 1;
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512 zero = _mm512_setzero_ps();
  const __m512i high_half = _mm512_set1_epi64((int64_t)0xFFFFFFFF00000000ULL);
  uint64_t fp = 0;
  __m512 lo = inf, hi = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512d s0 = _mm512_setzero_pd(), s1 = s0, ss0 = s0, ss1 = s0;
  int64_t zeros = 0;
  for (int64_t done = 0; done < n;) {
    const Segment sg(g + (uint64_t)done, n - done, kmask);
    sg.prefetch_next(n - done);
    const int64_t j0 = sg.j0, seg = sg.len;
    __m512i fp_lo = _mm512_setzero_si512(), fp_hi = _mm512_setzero_si512();  // as narrow_body
    const uint64_t* signs = &tb.sign64[sg.shift & 7][0][0];
    const uint32_t shift_hi = sg.shift >> 3;
    const __m512i flip = _mm512_set1_epi64((int64_t)((uint64_t)sg.negative() << 63));
    const typename E::T* xb = x + done;
    __mmask16 allfinite = 0xFFFF;
    for (int64_t t = 0; t < seg; t += 16) {
      const uint32_t q = (uint32_t)((j0 + t) >> 3);  // the first of the two lane groups
      __m512i bits;
      __m512 v;
      if constexpr (D == F32) {
        bits = _mm512_loadu_si512(xb + t);
        v = _mm512_castsi512_ps(bits);
      } else {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + t));
        bits = _mm512_cvtepu16_epi32(raw);
        if constexpr (D == BF16)
          v = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        else
          v = _mm512_cvtph_ps(raw);
      }
      const int64_t m = (j0 + t) >> 1;
      const __m512i odd = _mm512_srli_epi64(bits, 32);
      fp_lo = _mm512_add_epi64(
          fp_lo, _mm512_add_epi64(_mm512_mul_epu32(_mm512_load_si512(tb.even_key + m), bits),
                                  _mm512_mul_epu32(_mm512_load_si512(tb.odd_key + m), odd)));
      fp_hi = _mm512_add_epi32(fp_hi,
                               _mm512_mullo_epi32(_mm512_load_si512(tb.hi32 + j0 + t), bits));
      const __mmask16 fin = _mm512_cmp_ps_mask(_mm512_abs_ps(v), inf, _CMP_LT_OQ);
      allfinite &= fin;
      zeros += __builtin_popcount(_mm512_cmp_ps_mask(v, zero, _CMP_EQ_OQ));
      lo = _mm512_mask_min_ps(lo, fin, lo, v);
      hi = _mm512_mask_max_ps(hi, fin, hi, v);
      const __m512 f = _mm512_maskz_mov_ps(fin, v);
      const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
      const __m512d d1 = _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1));
      s0 = _mm512_add_pd(s0, d0);
      s1 = _mm512_add_pd(s1, d1);
      ss0 = _mm512_fmadd_pd(d0, d0, ss0);
      ss1 = _mm512_fmadd_pd(d1, d1, ss1);
      // Two lane groups, each to its own bucket group with its lanes permuted by its own XOR:
      // sign bits (the table's XOR the block's) flipped in one ternary op, then the permute.
      const uint32_t e0 = sg.place[q], e1 = sg.place[q + 1];
      const __m512d p0 = _mm512_permutexvar_pd(
          _mm512_load_si512(tb.perm8_64[e0 >> 5]),
          _mm512_castsi512_pd(_mm512_ternarylogic_epi64(
              _mm512_castpd_si512(d0), _mm512_load_si512(signs + 8 * (q ^ shift_hi)), flip, 0x96)));
      const __m512d p1 = _mm512_permutexvar_pd(
          _mm512_load_si512(tb.perm8_64[e1 >> 5]),
          _mm512_castsi512_pd(_mm512_ternarylogic_epi64(
              _mm512_castpd_si512(d1), _mm512_load_si512(signs + 8 * ((q + 1) ^ shift_hi)), flip,
              0x96)));
      double* dst0 = a.sketch + (((8 * (e0 & 31)) ^ sg.high) & kmask);
      double* dst1 = a.sketch + (((8 * (e1 & 31)) ^ sg.high) & kmask);
      _mm512_storeu_pd(dst0, _mm512_add_pd(_mm512_loadu_pd(dst0), p0));
      _mm512_storeu_pd(dst1, _mm512_add_pd(_mm512_loadu_pd(dst1), p1));
    }
    // The block's sum, its 32-bit lanes folded in as in fold_hi, times P(b).
    fp += (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(
              fp_lo, _mm512_add_epi64(_mm512_slli_epi64(fp_hi, 32),
                                      _mm512_and_si512(fp_hi, high_half)))) *
          sg.power;
    if (allfinite != 0xFFFF) classify_nonfinite<D>(xb, seg, a);
    done += seg;
  }
  a.zeros += zeros;
  a.fp += fp;
  const double l = _mm512_reduce_min_ps(lo), u = _mm512_reduce_max_ps(hi);
  a.lo = l < a.lo ? l : a.lo;
  a.hi = u > a.hi ? u : a.hi;
  alignas(64) double sv[8], qv[8];
  _mm512_store_pd(sv, _mm512_add_pd(s0, s1));
  _mm512_store_pd(qv, _mm512_add_pd(ss0, ss1));
  a.sum += ((sv[0] + sv[1]) + (sv[2] + sv[3])) + ((sv[4] + sv[5]) + (sv[6] + sv[7]));
  a.sum_sq += ((qv[0] + qv[1]) + (qv[2] + qv[3])) + ((qv[4] + qv[5]) + (qv[6] + qv[7]));
}
#endif

#if NA_VECTOR512
// mix64 of eight 64-bit lanes (V(x) of float64 elements).
inline __m512i mix64x8(__m512i z) {
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64((int64_t)MIX_C1));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64((int64_t)MIX_C2));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// Contiguous float64, n a multiple of 8, g a multiple of 8, k >= 8, AVX-512: one lane group
// per step (vpmullq for mix64 and for T[j] * V, the moments on float64 lanes directly); a
// block's lanes of T[j] * V times P(b), one vpmullq per block.
void f64_body512(const uint64_t* x, int64_t n, uint64_t g, Acc& a) {
  const Tables& tb = tables();
  const uint64_t kmask = (uint64_t)a.k - 1;
  const __m512d inf = _mm512_set1_pd(std::numeric_limits<double>::infinity());
  const __m512d zero = _mm512_setzero_pd();
  __m512i fp = _mm512_setzero_si512();
  __m512d lo = inf, hi = _mm512_set1_pd(-std::numeric_limits<double>::infinity());
  __m512d s = zero, ss = zero;
  int64_t zeros = 0;
  for (int64_t done = 0; done < n;) {
    const Segment sg(g + (uint64_t)done, n - done, kmask);
    sg.prefetch_next(n - done);
    const int64_t j0 = sg.j0, seg = sg.len;
    __m512i fp_seg = _mm512_setzero_si512();
    const uint64_t* signs64 = &tb.sign64[sg.shift & 7][0][0];
    const uint32_t shift_hi = sg.shift >> 3;
    const __m512i flip = _mm512_set1_epi64((int64_t)((uint64_t)sg.negative() << 63));
    const uint64_t* xb = x + done;
    __mmask8 allfinite = 0xFF;
    for (int64_t t = 0; t < seg; t += 8) {
      const uint32_t q = (uint32_t)((j0 + t) >> 3);
      const __m512i bits = _mm512_loadu_si512(xb + t);
      fp_seg = _mm512_add_epi64(
          fp_seg, _mm512_mullo_epi64(_mm512_load_si512(tb.key + j0 + t), mix64x8(bits)));
      const __m512d v = _mm512_castsi512_pd(bits);
      const __mmask8 fin = _mm512_cmp_pd_mask(_mm512_abs_pd(v), inf, _CMP_LT_OQ);
      allfinite &= fin;
      zeros += __builtin_popcount(_mm512_cmp_pd_mask(v, zero, _CMP_EQ_OQ));
      lo = _mm512_mask_min_pd(lo, fin, lo, v);
      hi = _mm512_mask_max_pd(hi, fin, hi, v);
      const __m512d f = _mm512_maskz_mov_pd(fin, v);
      s = _mm512_add_pd(s, f);
      ss = _mm512_fmadd_pd(f, f, ss);
      const __m512i sm = _mm512_xor_si512(_mm512_load_si512(signs64 + 8 * (q ^ shift_hi)), flip);
      const uint32_t e = sg.place[q];
      const __m512d p = _mm512_permutexvar_pd(
          _mm512_load_si512(tb.perm8_64[e >> 5]),
          _mm512_castsi512_pd(_mm512_xor_si512(_mm512_castpd_si512(f), sm)));
      double* dst = a.sketch + (((8 * (e & 31)) ^ sg.high) & kmask);
      _mm512_storeu_pd(dst, _mm512_add_pd(_mm512_loadu_pd(dst), p));
    }
    fp = _mm512_add_epi64(fp, _mm512_mullo_epi64(fp_seg, _mm512_set1_epi64((int64_t)sg.power)));
    if (allfinite != 0xFF) classify_nonfinite<F64>(xb, seg, a);
    done += seg;
  }
  a.zeros += zeros;
  a.fp += (uint64_t)_mm512_reduce_add_epi64(fp);
  const double l = _mm512_reduce_min_pd(lo), u = _mm512_reduce_max_pd(hi);
  a.lo = l < a.lo ? l : a.lo;
  a.hi = u > a.hi ? u : a.hi;
  alignas(64) double sv[8], qv[8];
  _mm512_store_pd(sv, s);
  _mm512_store_pd(qv, ss);
  a.sum += ((sv[0] + sv[1]) + (sv[2] + sv[3])) + ((sv[4] + sv[5]) + (sv[6] + sv[7]));
  a.sum_sq += ((qv[0] + qv[1]) + (qv[2] + qv[3])) + ((qv[4] + qv[5]) + (qv[6] + qv[7]));
}

void f64_run(const uint64_t* x, int64_t n, uint64_t g, Acc& a) {
  int64_t head = (int64_t)((8 - (g & 7)) & 7);
  if (head > n) head = n;
  scalar_run<F64>(x, 1, head, g, 1, a);
  x += head, g += (uint64_t)head, n -= head;
  const int64_t body = n & ~(int64_t)7;
  if (body) f64_body512(x, body, g, a);
  scalar_run<F64>(x + body, 1, n - body, g + (uint64_t)body, 1, a);
}
#endif

// Contiguous float32/bfloat16/float16 at global indices g, g + 1, ...: a scalar head up to the
// next multiple of the vector width, the vector body, a scalar tail.
template <int64_t D>
void narrow_run(const typename Elem<D>::T* x, int64_t n, uint64_t g, Acc& a) {
#if NA_VECTOR512
  const int64_t width = 16;
#else
  const int64_t width = 8;
#endif
  int64_t head = (int64_t)((width - (int64_t)(g & (uint64_t)(width - 1))) & (width - 1));
  if (head > n) head = n;
  scalar_run<D>(x, 1, head, g, 1, a);
  x += head, g += (uint64_t)head, n -= head;
  const int64_t body = n & ~(width - 1);
  if (body) {
#if NA_VECTOR512
    if (width == 16)
      narrow_body512<D>(x, body, g, a);
    else
#endif
      if (a.assume_finite)
        narrow_body<D, true>(x, body, g, a);
      else
        narrow_body<D, false>(x, body, g, a);
  }
  scalar_run<D>(x + body, 1, n - body, g + (uint64_t)body, 1, a);
}
#endif

// One innermost run: n elements at x[t * ts], global indices g + t * gs.
template <int64_t D>
void run(const void* p, int64_t ts, int64_t n, uint64_t g, uint64_t gs, Acc& a) {
  using T = typename Elem<D>::T;
  const T* x = static_cast<const T*>(p);
#if NA_VECTOR
  if constexpr (D == F32 || D == BF16 || D == F16) {
    if (gs == 1 && a.k >= 8) {
      if (ts == 1) {
        narrow_run<D>(x, n, g, a);
        return;
      }
      // Strided in memory, contiguous in the logical tensor: gather pieces that end on block
      // boundaries into a buffer, so only the first piece has a scalar head.
      alignas(64) T buf[LANES];
      for (int64_t t = 0; t < n;) {
        int64_t m = LANES - (int64_t)((g + (uint64_t)t) & (LANES - 1));
        if (m > n - t) m = n - t;
        for (int64_t u = 0; u < m; ++u) buf[u] = x[(t + u) * ts];
        narrow_run<D>(buf, m, g + (uint64_t)t, a);
        t += m;
      }
      return;
    }
  }
#endif
#if NA_VECTOR512
  if constexpr (D == F64) {
    if (gs == 1 && ts == 1 && a.k >= 8) {
      f64_run(x, n, g, a);
      return;
    }
  }
#endif
  constexpr bool is_float = D == F16 || D == BF16 || D == F32 || D == F64;
  if constexpr (!is_float) {
    if (gs == 1) {
      if (ts == 1)
        int_run<D, true>(x, 1, n, g, a);
      else
        int_run<D, false>(x, ts, n, g, a);
      return;
    }
  }
  scalar_run<D>(x, ts, n, g, gs, a);
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

// Sketches of up to this many buckets (32 KiB) accumulate in an aligned stack buffer.
constexpr int64_t LOCAL_SKETCH = 4096;

// Digest one piece described by `desc`: [data, dtype, ndim, gbase, payload, (size, tstride,
// gstride) x ndim], strides in elements, dims outermost first. `payload`, when not 0, is where
// the piece's elements are also copied to, packed in C order (the bytes of a contiguous copy).
// Returns the number of int64s consumed, or -1 for a bad descriptor (the row is then left
// untouched).
int64_t digest_one(const int64_t* desc, int64_t k, double* f64, int64_t* i64) {
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
  // The sketch accumulates in a 64-byte-aligned buffer on the stack when it fits, then is
  // copied to the row (zero for pieces without moments). Straight into the row, whose
  // buckets start 40 bytes into it, every vector access to a bucket group straddled two cache
  // lines: the float32 loop ran at half the speed. Same additions in the same order either way.
  alignas(64) double local[LOCAL_SKETCH];
  double* const out = f64 + N_MOMENTS;
  const int64_t itemsz = itemsize(dtype);
  Acc a;
  // One pass over the piece's runs; `payload` is filled on the first pass only.
  auto walk = [&](bool assume_finite, char* payload) {
    a = Acc();
    a.sketch = k <= LOCAL_SKETCH ? local : out;
    std::memset(a.sketch, 0, sizeof(double) * k);
    a.k = k;
    a.assume_finite = assume_finite;
    if (numel == 0) return;
    if (nd == 0) {  // one element
      fn(data, 1, 1, gbase, 1, a);
      if (payload) std::memcpy(payload, data, itemsz);
      return;
    }
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
      fn(data + off * itemsz, ts[inner], size[inner], g, (uint64_t)gs[inner], a);
      if (payload) {
        copy_run(data + off * itemsz, ts[inner], itemsz, size[inner], payload);
        payload += size[inner] * itemsz;
      }
      int64_t d = inner - 1;
      while (d >= 0 && ++coord[d] == size[d]) coord[d--] = 0;
      if (d < 0) break;
    }
  };
  walk(true, payload);
  if (a.redo) walk(false, nullptr);  // NaN/Inf met by the unmasked loop: digest it masked
  if (a.sketch != out) std::memcpy(out, a.sketch, sizeof(double) * k);
  f64[0] = moments ? a.sum : 0.0;
  f64[1] = moments ? a.sum_sq : 0.0;
  f64[2] = moments ? a.lo : inf;
  f64[3] = moments ? a.hi : -inf;
  f64[4] = moments && a.lo <= a.hi ? std::fmax(std::fabs(a.lo), std::fabs(a.hi)) : 0.0;
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
// [n, 5 + k] and i64 [n, 6]. Returns 0, or 1 + the index of the first bad descriptor.
int64_t NA_CAT(numaudit_digest_batch_, NA_ISA)(int64_t n, const int64_t* desc, int64_t k,
                                              double* f64, int64_t* i64) {
  // No std:: containers anywhere in this file: their out-of-line template code is shared
  // between the per-ISA objects at link time, so AVX-512 code could run on an AVX2 CPU.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t used = digest_one(desc, k, f64 + i * (N_MOMENTS + k), i64 + i * 6);
    if (used < 0) return i + 1;
    desc += used;
  }
  return 0;
}

}  // extern "C"
