// Entry points of libnumaudit_digest.so: picks the digest built for the best ISA level this CPU
// supports (see digest_cpu.cpp) once, at the first call.

#include <cstdint>
#include <cstdlib>

extern "C" {
int64_t numaudit_digest_batch_v4(int64_t, const int64_t*, int64_t, double*, int64_t*);
int64_t numaudit_digest_batch_v3(int64_t, const int64_t*, int64_t, double*, int64_t*);
int64_t numaudit_digest_batch_base(int64_t, const int64_t*, int64_t, double*, int64_t*);
}

namespace {

using Fn = int64_t (*)(int64_t, const int64_t*, int64_t, double*, int64_t*);

int detected() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return 4;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2") &&
      __builtin_cpu_supports("movbe"))
    return 3;
  return 1;
}

// NUMAUDIT_DIGEST_ISA=1|3|4 picks a lower level than the CPU's best (tests run every build on
// one machine); a level the CPU lacks is ignored.
int level() {
  const int best = detected();
  const char* want = std::getenv("NUMAUDIT_DIGEST_ISA");
  if (want && want[0] >= '1' && want[0] <= '4' && want[1] == 0 && want[0] - '0' <= best)
    return want[0] - '0' == 2 ? 1 : want[0] - '0';
  return best;
}

Fn pick() {
  switch (level()) {
    case 4: return numaudit_digest_batch_v4;
    case 3: return numaudit_digest_batch_v3;
    default: return numaudit_digest_batch_base;
  }
}

}  // namespace

extern "C" {

// Version of the descriptor format; the loader refuses a library built from other sources.
int64_t numaudit_digest_abi(void) { return 3; }

// ISA level in use: 4 (AVX-512), 3 (AVX2) or 1 (baseline x86-64).
int64_t numaudit_digest_isa(void) { return level(); }

int64_t numaudit_digest_batch(int64_t n, const int64_t* desc, int64_t k, double* f64,
                              int64_t* i64) {
  static const Fn fn = pick();
  return fn(n, desc, k, f64, i64);
}

}  // extern "C"
