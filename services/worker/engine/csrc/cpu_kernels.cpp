// CPU decode kernels of the pdserve worker (services/worker/engine/cpu_kernels.py says why and
// what they measured): a few-row fp32 product over weights in 16-feature panels, decode
// attention over the paged KV pool, and huge-page buffers. Built by torch's extension builder
// (cpu_kernels._compile) with -Wall -Wextra -Werror (CI checks that it built so); formatted by
// clang-format (.clang-format at the repository root; make lint).
// GCC 12's intrinsic headers trip -Wmaybe-uninitialized where a 512-bit register is split in
// halves (their _mm256_undefined_pd initialises itself; GCC bug 105593): silenced for the
// headers only, our own code keeps the warning.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#pragma GCC diagnostic pop
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <sys/mman.h>

bool has_avx512();
bool has_avx2();

namespace {
constexpr int64_t P = 16;  // panel width

// whether a kernel runs its AVX-512 code (isa 0 auto, 1 avx2, 2 avx512), refusing an instruction
// set the CPU lacks
bool use_avx512(int64_t isa, const char* kernel) {
  const bool avx512 = isa == 2 || (isa == 0 && has_avx512());
  TORCH_CHECK(avx512 ? has_avx512() : has_avx2(), kernel, ": this CPU lacks the instruction set");
  return avx512;
}

// One pass of rows m0..m0+M-1 of x over NP consecutive panels (each K x 16), into out's
// columns. PF > 0: the pass also asks for later weights into L2, PF lines per k, from pf on at
// pf_step bytes per k (see `panels`).
template <int M, int NP, int PF>
__attribute__((target("avx512f"))) void tile512(const float* x, int64_t ldx, const float* w, int64_t K,
                                                float* out, int64_t ldo, const char* pf, int64_t pf_step) {
  __m512 acc[M][NP];
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < NP; ++q) acc[m][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    for (int i = 0; i < PF; ++i) _mm_prefetch(pf + k * pf_step + 64 * i, _MM_HINT_T1);
    __m512 wv[NP];
    for (int q = 0; q < NP; ++q) wv[q] = _mm512_loadu_ps(w + q * K * P + k * P);
    for (int m = 0; m < M; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      for (int q = 0; q < NP; ++q) acc[m][q] = _mm512_fmadd_ps(xb, wv[q], acc[m][q]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < NP; ++q) _mm512_storeu_ps(out + m * ldo + q * P, acc[m][q]);
}

template <int M, int NP, int PF>
__attribute__((target("avx2,fma"))) void tile256(const float* x, int64_t ldx, const float* w, int64_t K,
                                                 float* out, int64_t ldo, const char* pf, int64_t pf_step) {
  __m256 acc[M][NP][2];
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < NP; ++q) acc[m][q][0] = acc[m][q][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    for (int i = 0; i < PF; ++i) _mm_prefetch(pf + k * pf_step + 64 * i, _MM_HINT_T1);
    __m256 wv[NP][2];
    for (int q = 0; q < NP; ++q) {
      wv[q][0] = _mm256_loadu_ps(w + q * K * P + k * P);
      wv[q][1] = _mm256_loadu_ps(w + q * K * P + k * P + 8);
    }
    for (int m = 0; m < M; ++m) {
      const __m256 xb = _mm256_set1_ps(x[m * ldx + k]);
      for (int q = 0; q < NP; ++q) {
        acc[m][q][0] = _mm256_fmadd_ps(xb, wv[q][0], acc[m][q][0]);
        acc[m][q][1] = _mm256_fmadd_ps(xb, wv[q][1], acc[m][q][1]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < NP; ++q) {
      _mm256_storeu_ps(out + m * ldo + q * P, acc[m][q][0]);
      _mm256_storeu_ps(out + m * ldo + q * P + 8, acc[m][q][1]);
    }
}

// One pass: M rows over NP panels at w, on the chosen ISA; AVX2 (16 vector registers) covers
// 4 rows one panel at a time. With prefetch (pf non-null) the pass takes `passes` consecutive
// slices of the next panels' prefetch stream, advancing `pf` past them.
template <int M, int NP>
void pass(bool avx512, const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
          const char*& pf, int64_t pf_step) {
  if (avx512) {
    if (!pf) tile512<M, NP, 0>(x, ldx, w, K, out, ldo, pf, 0);
    else if (pf_step > 64) tile512<M, NP, 2>(x, ldx, w, K, out, ldo, pf, pf_step);
    else tile512<M, NP, 1>(x, ldx, w, K, out, ldo, pf, pf_step);
    if (pf) pf += K * pf_step;
  } else if constexpr (M <= 4) {  // AVX2 never runs 8-row tiles
    if constexpr (M > 2 && NP == 2) {
      pass<M, 1>(false, x, ldx, w, K, out, ldo, pf, pf_step);
      pass<M, 1>(false, x, ldx, w + K * P, K, out + P, ldo, pf, pf_step);
    } else {
      if (!pf) tile256<M, NP, 0>(x, ldx, w, K, out, ldo, pf, 0);
      else if (pf_step > 64) tile256<M, NP, 2>(x, ldx, w, K, out, ldo, pf, pf_step);
      else tile256<M, NP, 1>(x, ldx, w, K, out, ldo, pf, pf_step);
      if (pf) pf += K * pf_step;
    }
  }
}

// the row tiles a step of `rows` runs, largest first: 8 / 4 / 2 / 1 (AVX-512) or 4 / 2 / 1
// (AVX2); returns how many
int row_tiles(bool avx512, int64_t rows, int* tiles) {
  int n = 0;
  for (int64_t left = rows; left > 0; ++n) {
    tiles[n] = (avx512 && left >= 8) ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    left -= tiles[n];
  }
  return n;
}

// Every row of x times NP panels, tile by tile, the panels staying in cache between tiles.
// Only the first tile reads them from memory, so with several tiles (and at 8 rows on AVX-512)
// the core would stall on memory in the first and then compute from cache: with `prefetch` the
// passes together ask for the next NP panels, one pass's share at a time, at the rate the
// passes consume these (2 x 64 B per k over all passes), so memory keeps streaming while the
// core computes. (SmolLM2's 30 layers, 8 rows, one core of the 2-core EPYC: AVX2 43.2 -> 24.3 ms,
// AVX-512 26.3 -> 22.8 ms. Below 3 rows with AVX2 and 6 with AVX-512 the first pass already
// streams at about the memory rate and the extra requests only cost, so `panel_mm` leaves them
// out there.)
template <int NP>
void panels(bool avx512, bool prefetch, const float* x, int64_t rows, int64_t ldx, const float* w, int64_t K,
            float* out, int64_t ldo) {
  int tiles[64];
  const int n = row_tiles(avx512, rows, tiles);
  int passes = 0;
  for (int i = 0; i < n; ++i) passes += (!avx512 && tiles[i] == 4 && NP == 2) ? 2 : 1;
  const char* pf = prefetch ? reinterpret_cast<const char*>(w + NP * K * P) : nullptr;
  const int64_t pf_step = NP * 64 / passes;  // bytes of the stream per k of each pass
  int64_t m = 0;
  for (int i = 0; i < n; ++i) {
    const float* xm = x + m * ldx;
    float* om = out + m * ldo;
    switch (tiles[i]) {
      case 8: pass<8, NP>(avx512, xm, ldx, w, K, om, ldo, pf, pf_step); break;
      case 4: pass<4, NP>(avx512, xm, ldx, w, K, om, ldo, pf, pf_step); break;
      case 2: pass<2, NP>(avx512, xm, ldx, w, K, om, ldo, pf, pf_step); break;
      default: pass<1, NP>(avx512, xm, ldx, w, K, om, ldo, pf, pf_step); break;
    }
    m += tiles[i];
  }
}

// asks for n floats from p on into L1: the next KV block of a sequence, whose blocks are
// scattered over the pool where the hardware prefetcher does not follow
inline void prefetch_rows(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// out[r * ostride] = scale * (q[r] . k) for the R query rows q (R x D, row-major) against one K
// row of D floats (D % 8 == 0; D % 16 == 0 for AVX-512): up to 4 query rows per pass over the K
// row, their 4 horizontal sums in one reduction tree
__attribute__((target("avx2"))) inline __m128 hsum4(__m256 h0, __m256 h1, __m256 h2, __m256 h3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h0, h1), _mm256_hadd_ps(h2, h3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

__attribute__((target("avx512f"))) void dots512(const float* q, int64_t R, const float* k, int64_t D,
                                                float scale, float* out, int64_t ostride) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t g = std::min<int64_t>(4, R - r0);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 kv = _mm512_loadu_ps(k + d);
      for (int j = 0; j < 4; ++j)
        if (j < g) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (r0 + j) * D + d), kv, acc[j]);
    }
    __m256 h[4];
    for (int j = 0; j < 4; ++j)
      h[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
    float sums[4];
    _mm_storeu_ps(sums, hsum4(h[0], h[1], h[2], h[3]));
    for (int64_t j = 0; j < g; ++j) out[(r0 + j) * ostride] = scale * sums[j];
  }
}

__attribute__((target("avx2,fma"))) void dots256(const float* q, int64_t R, const float* k, int64_t D,
                                                 float scale, float* out, int64_t ostride) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t g = std::min<int64_t>(4, R - r0);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kv = _mm256_loadu_ps(k + d);
      for (int j = 0; j < 4; ++j)
        if (j < g) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (r0 + j) * D + d), kv, acc[j]);
    }
    float sums[4];
    _mm_storeu_ps(sums, hsum4(acc[0], acc[1], acc[2], acc[3]));
    for (int64_t j = 0; j < g; ++j) out[(r0 + j) * ostride] = scale * sums[j];
  }
}

// out[r, c] += p[r * pstride + t] * v[t, c] for t = 0..n-1 in order (one FMA each, as a
// per-token axpy would), r < G, over the NC vectors of columns at v / out (rows ld floats apart).
// The G x NC outputs stay in registers over the n value rows, which are read in order (rows of a
// block are consecutive in memory), each asking for the same columns of the next block's row (pf).
template <int G, int NC>
__attribute__((target("avx512f"))) void pv512(const float* p, int64_t pstride, int64_t n, const float* v,
                                              int64_t ld, float* out, const float* pf) {
  __m512 acc[G][NC];
  for (int r = 0; r < G; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_loadu_ps(out + r * ld + c * 16);
  for (int64_t t = 0; t < n; ++t) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + t * ld + c * 16), _MM_HINT_T0);
      vv[c] = _mm512_loadu_ps(v + t * ld + c * 16);
    }
    for (int r = 0; r < G; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * pstride + t]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < G; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + r * ld + c * 16, acc[r][c]);
}

// AVX-512: the weighted sum of n V rows (D floats each) into the R output rows, query rows in
// groups of up to 4 and 64 columns at a time where D allows (16 otherwise), every accumulator in
// a register
template <int G>
void pv_group(const float* p, int64_t pstride, int64_t n, const float* v, int64_t D, float* out,
              const float* pf) {
  const int64_t width = D % 64 == 0 ? 64 : 16;
  for (int64_t c0 = 0; c0 < D; c0 += width) {
    const float* pfc = pf ? pf + c0 : nullptr;
    if (width == 64) pv512<G, 4>(p, pstride, n, v + c0, D, out + c0, pfc);
    else pv512<G, 1>(p, pstride, n, v + c0, D, out + c0, pfc);
  }
}

// out[r] += p[r] * v for R rows of D floats (accumulators in memory: D is small)
__attribute__((target("avx2,fma"))) void axpy256(const float* p, int64_t pstride, int64_t R, const float* v,
                                                 float* out, int64_t D) {
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 vv = _mm256_loadu_ps(v + d);
    for (int64_t r = 0; r < R; ++r)
      _mm256_storeu_ps(out + r * D + d,
                       _mm256_fmadd_ps(_mm256_set1_ps(p[r * pstride]), vv, _mm256_loadu_ps(out + r * D + d)));
  }
}

// out[r, :] += p[r * pstride + t] * v[t, :] over a block's n rows, in order; pf: the next block.
// AVX2 (16 registers) keeps the outputs in memory and takes whole value rows one by one: its
// register-held variant needs two passes per row, which streamed slower from memory (8.9 against
// 7.4 ms per step for 8 sequences of 319 tokens).
void pv(bool avx512, const float* p, int64_t pstride, int64_t R, int64_t n, const float* v, int64_t D,
        float* out, const float* pf) {
  if (!avx512) {
    for (int64_t t = 0; t < n; ++t) {
      if (pf)
        for (int64_t c = 0; c < D; c += 16)
          _mm_prefetch(reinterpret_cast<const char*>(pf + t * D + c), _MM_HINT_T0);
      axpy256(p + t, pstride, R, v + t * D, out, D);
    }
    return;
  }
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const float* pr = p + r0 * pstride;
    float* outr = out + r0 * D;
    const float* pfr = r0 == 0 ? pf : nullptr;  // the next block's rows: asked for once
    switch (std::min<int64_t>(4, R - r0)) {
      case 1: pv_group<1>(pr, pstride, n, v, D, outr, pfr); break;
      case 2: pv_group<2>(pr, pstride, n, v, D, outr, pfr); break;
      case 3: pv_group<3>(pr, pstride, n, v, D, outr, pfr); break;
      default: pv_group<4>(pr, pstride, n, v, D, outr, pfr); break;
    }
  }
}
}  // namespace

// One layer's decode attention for B sequences, one query token each: q [B, H, R, D] (the R
// query heads sharing each of the H KV heads), k and v [H, S, D] (the layer's pool of S slots),
// sequence b attending to its tokens starts[b] .. lens[b] - 1 (starts empty: from 0; a sliding
// window's first visible key otherwise), token l in slot blocks[b, l / bs] * bs + l % bs.
// -> [B, H, R, D]. Scores by the dot kernel, softmax by torch's (vectorized) kernel over
// [B, H, R, max span] with -inf padding, then the probability-weighted sum of V rows; each
// block's rows are read in place, in order; blocks wholly before starts[b] are never read.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& blocks, const torch::Tensor& lens,
                               const torch::Tensor& starts, int64_t bs, double scale, int64_t isa) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3 && v.sizes() == k.sizes(), "decode_attention: bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: fp32 only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && blocks.is_contiguous(),
              "decode_attention: contiguous only");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = k.size(1);
  TORCH_CHECK(k.size(0) == H && k.size(2) == D && D % 16 == 0, "decode_attention: head sizes differ");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == B && lens.numel() == B &&
                  blocks.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && bs >= 1,
              "decode_attention: one int64 block-table row and length per sequence");
  TORCH_CHECK(starts.numel() == 0 ||
                  (starts.numel() == B && starts.scalar_type() == at::kLong && starts.is_contiguous()),
              "decode_attention: starts is empty or one int64 first key per sequence");
  const bool avx512 = use_avx512(isa, "decode_attention");
  const int64_t NB = blocks.size(1);
  const int64_t* bt = blocks.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t* st = starts.numel() ? starts.data_ptr<int64_t>() : nullptr;
  int64_t lmax = 1;  // the longest span: scores row width
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = st ? st[b] : 0;
    TORCH_CHECK(ln[b] >= 1 && (ln[b] + bs - 1) / bs <= NB, "decode_attention: slots out of the pool");
    TORCH_CHECK(first >= 0 && first < ln[b], "decode_attention: a first key outside its sequence");
    for (int64_t j = first / bs; j < (ln[b] + bs - 1) / bs; ++j) {
      const int64_t blk = bt[b * NB + j];
      TORCH_CHECK(blk >= 0 && (blk + 1) * bs <= S, "decode_attention: slots out of the pool");
    }
    lmax = std::max(lmax, ln[b] - first);
  }
  pybind11::gil_scoped_release no_gil;
  auto scores = torch::full({B, H, R, lmax}, -std::numeric_limits<float>::infinity(), q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* sp = scores.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bh = b0; bh < b1; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const int64_t first = st ? st[b] : 0;
      float* srow = sp + bh * R * lmax;  // token l's score at srow[l - first]
      for (int64_t l0 = first / bs * bs; l0 < ln[b]; l0 += bs) {
        const float* kb = kp + (h * S + bt[b * NB + l0 / bs] * bs) * D;
        const float* kn = l0 + bs < ln[b] ? kp + (h * S + bt[b * NB + l0 / bs + 1] * bs) * D : nullptr;
        for (int64_t i = std::max<int64_t>(0, first - l0); i < std::min(bs, ln[b] - l0); ++i) {
          if (kn) prefetch_rows(kn + i * D, D);
          if (avx512) dots512(qp + bh * R * D, R, kb + i * D, D, sc, srow + l0 + i - first, lmax);
          else dots256(qp + bh * R * D, R, kb + i * D, D, sc, srow + l0 + i - first, lmax);
        }
      }
    }
  });
  const auto probs = at::_softmax(scores, -1, false);
  auto out = torch::zeros({B, H, R, D}, q.options());
  const float* pp = probs.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bh = b0; bh < b1; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const int64_t first = st ? st[b] : 0;
      const float* prow = pp + bh * R * lmax;  // token l's probability at prow[l - first]
      float* orow = op + bh * R * D;
      for (int64_t l0 = first / bs * bs; l0 < ln[b]; l0 += bs) {
        const int64_t i0 = std::max<int64_t>(0, first - l0);  // the block's first visible row
        const float* vb = vp + (h * S + bt[b * NB + l0 / bs] * bs) * D;
        const float* vn = l0 + bs < ln[b] ? vp + (h * S + bt[b * NB + l0 / bs + 1] * bs) * D : nullptr;
        pv(avx512, prow + l0 + i0 - first, lmax, R, std::min(bs, ln[b] - l0) - i0, vb + i0 * D, D, orow, vn);
      }
    }
  });
  return out;
}

// nbytes of uninitialized memory on 2 MiB-aligned pages that the kernel is asked to back with
// transparent huge pages (madvise: a hint; where THP is off they stay 4 KiB pages), freed with
// the tensor's storage
torch::Tensor huge_empty(int64_t nbytes) {
  constexpr int64_t HP = 2 << 20;
  TORCH_CHECK(nbytes >= 0, "huge_empty: negative size");
  const int64_t bytes = std::max<int64_t>(HP, (nbytes + HP - 1) / HP * HP);
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, HP, bytes) == 0, "huge_empty: cannot allocate ", bytes, " bytes");
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return torch::from_blob(p, {nbytes}, [](void* q) { free(q); }, torch::TensorOptions().dtype(torch::kUInt8));
}

bool has_avx512() { return __builtin_cpu_supports("avx512f"); }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// x [M, K] fp32 contiguous, w [N/16, K, 16] fp32 contiguous -> [M, N]; isa 0 auto, 1 avx2,
// 2 avx512; prefetch -1 auto (from the row count at which it paid on the measured CPUs), 0 off, 1 on
torch::Tensor panel_mm(const torch::Tensor& x, const torch::Tensor& w, int64_t isa, int64_t prefetch) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == P, "panel_mm: bad shapes");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "panel_mm: fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "panel_mm: contiguous tensors only");
  TORCH_CHECK(x.size(1) == w.size(1), "panel_mm: inner sizes differ");
  TORCH_CHECK(x.size(0) <= 64, "panel_mm: at most 64 rows");
  const bool avx512 = use_avx512(isa, "panel_mm");
  const int64_t rows = x.size(0), K = x.size(1), n_panels = w.size(0), N = n_panels * P;
  const bool pf = prefetch < 0 ? rows >= (avx512 ? 6 : 3) : prefetch > 0;
  auto out = torch::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t pairs = n_panels / 2;
  {
    // without the GIL, as torch's own ops: the ranks of a worker are threads of one process
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, pairs, 4, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g)
        panels<2>(avx512, pf, xp, rows, K, wp + 2 * g * K * P, K, op + 2 * g * P, N);
    });
    if (n_panels % 2)
      panels<1>(avx512, false, xp, rows, K, wp + (n_panels - 1) * K * P, K, op + (n_panels - 1) * P, N);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_mm", &panel_mm, "x [rows, K] @ panels [N/16, K, 16] -> [rows, N]");
  m.def("decode_attention", &decode_attention, "decode attention over the paged pool");
  m.def("huge_empty", &huge_empty, "uint8 tensor of nbytes on 2 MiB huge pages");
  m.def("has_avx512", &has_avx512, "whether the CPU has AVX-512F");
  m.def("has_avx2", &has_avx2, "whether the CPU has AVX2 and FMA");
}
