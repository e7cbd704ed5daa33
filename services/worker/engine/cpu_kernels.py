"""C++ kernels for CPU decode steps (fp32), built once per machine.

`panel_mm`: a small-batch matrix product, x [M, K] times a weight held as panels of 16 output
features (`[N/16, K, 16]`, each panel one contiguous K x 16 block), M <= 64 (the engine: <= 16).

Why: a decode step of a few sequences multiplies a few rows by every weight of the model once.
oneDNN's packed kernel streams those weights at ~12-14 GB/s on one core of the project's 2-core
AMD EPYC (AVX-512), half of what the core can read (~27 GB/s), and at 8 rows reaches ~50 GFLOP/s.
This kernel keeps a tile of rows x 32 outputs in registers (AVX-512: 8 x 2 zmm; AVX2: 4 x 2 ymm)
and streams two panels at a time, one fused multiply-add per weight vector and row; where a step
needs several row tiles, the tiles together prefetch the next panels at the rate they consume
them, so memory keeps streaming while the core computes from cache (`panels`). Over SmolLM2's
30 layers on one core (weights on huge pages, `empty_on_huge_pages`) it took 18.8 / 33.2 ms at
8 / 16 rows against oneDNN's 36.2 / 48.0 with AVX-512, and 18.8 / 35.1 against 50.6 / 66.0 with
AVX2 kernels (`python -m benchmarks.linear_kernels` compares them: the `panel_kernel`
contender). It stays ahead of oneDNN up to 64 rows there; the engine uses it up to MAX_ROWS.

Numerics of panel_mm: every output is x[m, 0] w[0] + ... + x[m, K-1] w[K-1] accumulated in that order with one
rounding per fused multiply-add, whatever M, the row's position in the step, the tile or the
instruction set (AVX-512 and AVX2 give the same bits): a row's result does not depend on the
batch it runs in.

`decode_attention`: one layer's attention for every decoding sequence of a step in one call
(from each sequence's first visible key: a sliding window's start, 0 without one),
each sequence's KV blocks read in place through its block table (consecutive, scattered or
shared with other sequences by the prefix cache alike), instead of one SDPA call per sequence:
scores a K row at a time for up to 4 query heads (their horizontal sums in one reduction tree),
torch's softmax, then the probability-weighted V rows (AVX-512: the outputs held in registers
over a block's rows). While it reads a block it asks for the sequence's next one, a row per
token (blocks lie anywhere in the pool, where the hardware prefetcher does not follow). 8
sequences of 319 tokens over 30 layers (SmolLM2's shapes, one core, pools on huge pages;
`python -m benchmarks.attention_kernel`, `attention-kernel-2026-11-26.json`): 7.4 ms (AVX-512) /
7.8 ms (AVX2) with consecutive blocks, 13.7 / 12.2 with shuffled ones, 4.6 / 6.5 from cache,
against 20.7 / 30.4 / 15.3 for SDPA per sequence (the path without the kernel); before the
prefetch the kernel took 8.3 / 16.0 (AVX-512, consecutive / shuffled). Its results are not
bit-equal across instruction sets (the dot products' reduction trees differ), only close (1e-6).

The C++ is built once per machine with torch's JIT extension builder (g++ and ninja; ~25 s),
cached on disk (torch's extension directory), and loaded in ~0.1 s by later processes. The ISA is
picked at run time (`__builtin_cpu_supports`, and AVX2 where torch's CPU capability is AVX2), so
one cached build serves AVX2 and AVX-512 hosts. The container image compiles it in its build
stage (`python -m services.worker.engine.cpu_kernels --prebuild`, into PREBUILT_DIR inside the
installed package), and its runtime, which has no compiler and a read-only root, loads that build.
Without a compiler or a prebuilt module, or on a CPU without AVX2 + FMA, `available()` is False
and callers keep their other kernels.

`empty_on_huge_pages`: the engine's big CPU buffers (the panel copies, the KV pool) on 2 MiB
transparent huge pages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

PANEL = 16  # output features per panel (floats)
# rows per call the engine gives the kernel (larger steps: oneDNN). 16: 27-47 % faster than
# oneDNN at 16 rows on both ISAs of the EPYC (notes above); beyond it fewer steps gain
MAX_ROWS = 16

# instruction sets `panel_mm(isa=...)` accepts (0: the best this CPU has)
ISA_AUTO, ISA_AVX2, ISA_AVX512 = 0, 1, 2

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
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
__attribute__((target("avx512f")))
void tile512(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
             const char* pf, int64_t pf_step) {
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
__attribute__((target("avx2,fma")))
void tile256(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
             const char* pf, int64_t pf_step) {
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
void pass(bool avx512, const float* x, int64_t ldx, const float* w, int64_t K, float* out,
          int64_t ldo, const char*& pf, int64_t pf_step) {
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
void panels(bool avx512, bool prefetch, const float* x, int64_t rows, int64_t ldx, const float* w,
            int64_t K, float* out, int64_t ldo) {
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
__attribute__((target("avx2")))
inline __m128 hsum4(__m256 h0, __m256 h1, __m256 h2, __m256 h3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h0, h1), _mm256_hadd_ps(h2, h3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

__attribute__((target("avx512f")))
void dots512(const float* q, int64_t R, const float* k, int64_t D, float scale, float* out, int64_t ostride) {
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

__attribute__((target("avx2,fma")))
void dots256(const float* q, int64_t R, const float* k, int64_t D, float scale, float* out, int64_t ostride) {
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
__attribute__((target("avx512f")))
void pv512(const float* p, int64_t pstride, int64_t n, const float* v, int64_t ld, float* out,
           const float* pf) {
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
__attribute__((target("avx2,fma")))
void axpy256(const float* p, int64_t pstride, int64_t R, const float* v, float* out, int64_t D) {
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
  TORCH_CHECK(starts.numel() == 0 || (starts.numel() == B && starts.scalar_type() == at::kLong &&
                                       starts.is_contiguous()),
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
"""

_lock = threading.Lock()
_module: Any = None
_tried = False
_isa = ISA_AVX2  # the ISA panel_mm uses by default (set when the module loads)


# Where an image keeps the kernels it built at build time (`prebuild`; the runtime image has no
# compiler and a read-only root filesystem). The name carries a hash of the source, so a build
# of other source is never loaded.
PREBUILT_DIR = Path(__file__).with_name("_prebuilt_kernels")
_NAME = "pdserve_cpu_kernels_" + hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]
_FUNCTIONS = ["panel_mm", "decode_attention", "huge_empty", "has_avx512", "has_avx2"]


def _compile(build_directory: str | None = None) -> Any:
    from torch.utils import cpp_extension

    try:  # torch's builder runs `ninja` from PATH; the pip package puts it next to Python
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    return cpp_extension.load_inline(
        name=_NAME,
        cpp_sources=_SOURCE,
        functions=_FUNCTIONS,
        extra_cflags=["-O3"],
        build_directory=build_directory,
        verbose=False,
    )


def _build() -> Any:
    """The prebuilt module where there is one (loaded as it is: nothing written), else torch's
    JIT build (compiled once per machine into torch's extension directory)."""
    prebuilt = PREBUILT_DIR / f"{_NAME}.so"
    if prebuilt.is_file():
        spec = importlib.util.spec_from_file_location(_NAME, prebuilt)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return _compile()


def prebuild(directory: Path = PREBUILT_DIR) -> Path:
    """Compile the kernels into `directory` (the image build does, where g++ is installed), for
    `_build` to load without a compiler; returns the module's path."""
    directory.mkdir(parents=True, exist_ok=True)
    _compile(str(directory))
    return directory / f"{_NAME}.so"


def _load() -> Any:
    """The built extension, or None when it cannot be built here (logged once)."""
    global _module, _tried, _isa
    with _lock:
        if not _tried:
            _tried = True
            try:
                mod = _build()
                _module = mod if mod.has_avx2() else None
                if _module is None:
                    log.info("CPU kernels: this CPU has no AVX2 + FMA; decode steps use the fallbacks")
                # AVX-512 where torch uses it too: ATEN_CPU_CAPABILITY=avx2 (which makes an
                # AVX-512 host take an AVX2 machine's code path) applies to this kernel as well
                elif mod.has_avx512() and "AVX512" in torch.backends.cpu.get_cpu_capability():
                    _isa = ISA_AVX512
            except Exception as exc:  # no compiler, no headers: the engine still runs
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                log.warning("CPU kernels unavailable (%s); decode steps use the fallbacks", first)
        return _module


def available() -> bool:
    """Whether the kernel can run in this process (builds or loads it on first call)."""
    return _load() is not None


def has_avx512() -> bool:
    """Whether the CPU has AVX-512 (whatever torch's capability setting)."""
    mod = _load()
    return bool(mod is not None and mod.has_avx512())


def panel_copy_applies(weight: torch.Tensor) -> bool:
    """Whether `panels_of` makes panels of this [N, K] weight (fp32 on CPU, N a multiple of 16,
    the kernel available)."""
    return (
        weight.dtype == torch.float32
        and weight.shape[0] % PANEL == 0
        and weight.device.type == "cpu"
        and available()
    )


def panels_of(weight: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor | None:
    """W [N, K] as [N/16, K, 16] (panel j: output features 16j..16j+15, K-major), or None where the
    kernel does not apply (`panel_copy_applies`). into: N x K contiguous fp32 elements to hold
    them (a slice of a shared buffer), else new memory."""
    if not panel_copy_applies(weight):
        return None
    n, k = weight.shape
    src = weight.detach().view(n // PANEL, PANEL, k).transpose(1, 2)
    if into is None:
        return src.contiguous()
    return into.view(n // PANEL, k, PANEL).copy_(src)


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose memory is 2 MiB-aligned and advised for transparent huge
    pages, or torch.empty's where the kernels are not built.

    Why: a decode step streams every weight and its sequences' KV once; on 4 KiB pages that walk
    misses the TLB every 4 KiB. On the 2-core EPYC a one-core sum read 26.5 GB/s from torch's
    memory and 33.7 GB/s from huge pages, and the panel product over SmolLM2's layers got ~20 %
    faster. (torch itself does this for every large allocation with THP_MEM_ALLOC_ENABLE=1, a
    process-wide switch read once at start-up; this is for the engine's big buffers only.)"""
    numel = math.prod(shape)
    mod = _load()
    if mod is None:
        return torch.empty(shape, dtype=dtype)
    return mod.huge_empty(numel * dtype.itemsize).view(dtype).view(shape)


def decode_attention(
    q: torch.Tensor,  # [B, H, R, D]: each sequence's query token, R query heads per KV head
    k: torch.Tensor,  # [H, S, D]: the layer's K pool (S slots = blocks x block_size)
    v: torch.Tensor,  # [H, S, D]
    blocks: torch.Tensor,  # [B, max blocks] int64: each sequence's block table (padding unread)
    lens: torch.Tensor,  # [B] int64: its context length (tokens)
    block_size: int,  # tokens per block
    scale: float,
    isa: int | None = None,
    starts: torch.Tensor | None = None,  # [B] int64: its first visible key (a sliding window)
) -> torch.Tensor:
    """One layer's decode attention for every sequence in one call, reading each sequence's
    blocks in place -> [B, H, R, D] (fp32, D a multiple of 16). Sequence b attends to its keys
    starts[b] .. lens[b] - 1 (all of them without `starts`); blocks wholly before its first key
    are not read."""
    mod = _load()
    assert mod is not None, "decode_attention without the kernels (check available() first)"
    chosen = _isa if isa is None else isa
    first = _NO_STARTS if starts is None else starts.contiguous()
    return mod.decode_attention(q.contiguous(), k, v, blocks, lens, first, block_size, scale, chosen)


_NO_STARTS = torch.empty(0, dtype=torch.int64)  # decode_attention: every sequence from key 0


def panel_mm(
    x: torch.Tensor, panels: torch.Tensor, isa: int | None = None, prefetch: bool | None = None
) -> torch.Tensor:
    """x [M, K] times the panelled weight -> [M, N] (= x W^T), fp32, M <= 64; isa: unless given,
    AVX-512 where the CPU has it and torch's CPU capability includes it, else AVX2 (ISA_AUTO: the
    best the CPU has); prefetch: unless given, from the row count (same results either way)."""
    mod = _load()
    assert mod is not None, "panel_mm without the kernel (check available() first)"
    pf = -1 if prefetch is None else int(prefetch)
    return mod.panel_mm(x.contiguous(), panels, _isa if isa is None else isa, pf)


if __name__ == "__main__":  # python -m services.worker.engine.cpu_kernels --prebuild (the image)
    import sys

    if sys.argv[1:] != ["--prebuild"]:
        sys.exit("usage: python -m services.worker.engine.cpu_kernels --prebuild")
    print(prebuild())
