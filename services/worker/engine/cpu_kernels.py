"""C++ kernels for CPU decode steps (fp32), built once per machine.

`panel_mm`: a small-batch matrix product, x [M, K] times a weight held as panels of 16 output
features (`[N/16, K, 16]`, each panel one contiguous K x 16 block), M <= 8.

Why: a decode step of a few sequences multiplies a few rows by every weight of the model once.
oneDNN's packed kernel streams those weights at ~12-14 GB/s on one core of the project's 2-core
AMD EPYC (AVX-512), half of what the core can read (~27 GB/s), and at 8 rows reaches ~50 GFLOP/s.
This kernel keeps a tile of rows x 32 outputs in registers (AVX-512: 8 x 2 zmm; AVX2: 4 x 2 ymm)
and streams two panels at a time, one fused multiply-add per weight vector and row: over
SmolLM2's 30 layers and LM head on one core it took 20.8 / 21.7 / 22.4 / 28.8 ms at 1 / 2 / 4 / 8
rows against oneDNN's 39.5 / 43.9 / 31.9 / 41.5 (`python -m benchmarks.linear_kernels` compares
them over the 30 layers: the `panel_kernel` contender).

Numerics of panel_mm: every output is x[m, 0] w[0] + ... + x[m, K-1] w[K-1] accumulated in that order with one
rounding per fused multiply-add, whatever M, the row's position in the step, the tile or the
instruction set (AVX-512 and AVX2 give the same bits): a row's result does not depend on the
batch it runs in.

`decode_attention`: one layer's attention for every decoding sequence of a step in one call,
each sequence's KV blocks read in place through its block table (consecutive, scattered or
shared with other sequences by the prefix cache alike; scores by an AVX dot kernel, softmax by
torch's, then the weighted sum of V rows), instead of one SDPA call per sequence: for 8
sequences of 319 tokens over 30 layers (SmolLM2's shapes, one core) 9.1 against 18.4 ms. Its
results are not bit-equal across instruction sets (the dot products' reduction trees differ),
only close (1e-6).

The C++ is built once per machine with torch's JIT extension builder (g++ and ninja; ~25 s),
cached on disk (torch's extension directory), and loaded in ~0.1 s by later processes. The ISA is
picked at run time (`__builtin_cpu_supports`, and AVX2 where torch's CPU capability is AVX2), so
one cached build serves AVX2 and AVX-512 hosts.
Without a compiler, or on a CPU without AVX2 + FMA, `available()` is False and callers keep their
other kernels.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

PANEL = 16  # output features per panel (floats)
MAX_ROWS = 8  # rows per call the kernel is meant for (larger steps: oneDNN)

# instruction sets `panel_mm(isa=...)` accepts (0: the best this CPU has)
ISA_AUTO, ISA_AVX2, ISA_AVX512 = 0, 1, 2

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <limits>

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

// rows m0..m0+M-1 of x times NP consecutive panels (each K x 16), into out's columns
template <int M, int NP>
__attribute__((target("avx512f")))
void tile512(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  __m512 acc[M][NP];
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < NP; ++q) acc[m][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
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

template <int M, int NP>
__attribute__((target("avx2,fma")))
void tile256(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  __m256 acc[M][NP][2];
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < NP; ++q) acc[m][q][0] = acc[m][q][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
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

// every row of x times NP panels: row tiles of 8 / 4 / 2 / 1 (AVX-512) or 4 / 2 / 1 (AVX2,
// which has 16 vector registers), the panels staying in cache between tiles
template <int NP>
void panels(bool avx512, const float* x, int64_t rows, int64_t ldx, const float* w, int64_t K,
            float* out, int64_t ldo) {
  int64_t m = 0;
  while (m < rows) {
    const int64_t left = rows - m;
    const float* xm = x + m * ldx;
    float* om = out + m * ldo;
    if (avx512) {
      if (left >= 8) { tile512<8, NP>(xm, ldx, w, K, om, ldo); m += 8; }
      else if (left >= 4) { tile512<4, NP>(xm, ldx, w, K, om, ldo); m += 4; }
      else if (left >= 2) { tile512<2, NP>(xm, ldx, w, K, om, ldo); m += 2; }
      else { tile512<1, NP>(xm, ldx, w, K, om, ldo); m += 1; }
    } else {
      if (left >= 4) { tile256<4, 1>(xm, ldx, w, K, om, ldo);
                       if (NP == 2) tile256<4, 1>(xm, ldx, w + K * P, K, om + P, ldo); m += 4; }
      else if (left >= 2) { tile256<2, NP>(xm, ldx, w, K, om, ldo); m += 2; }
      else { tile256<1, NP>(xm, ldx, w, K, om, ldo); m += 1; }
    }
  }
}

// dot product of two rows of D floats (D % 8 == 0; D % 16 == 0 for the AVX-512 path)
__attribute__((target("avx512f")))
float dot512(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx2,fma")))
float dot256(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[r] += p[r] * v for R rows of D floats (accumulators in memory: D is small)
__attribute__((target("avx512f")))
void axpy512(const float* p, int64_t pstride, int64_t R, const float* v, float* out, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 vv = _mm512_loadu_ps(v + d);
    for (int64_t r = 0; r < R; ++r)
      _mm512_storeu_ps(out + r * D + d,
                       _mm512_fmadd_ps(_mm512_set1_ps(p[r * pstride]), vv, _mm512_loadu_ps(out + r * D + d)));
  }
}

__attribute__((target("avx2,fma")))
void axpy256(const float* p, int64_t pstride, int64_t R, const float* v, float* out, int64_t D) {
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 vv = _mm256_loadu_ps(v + d);
    for (int64_t r = 0; r < R; ++r)
      _mm256_storeu_ps(out + r * D + d,
                       _mm256_fmadd_ps(_mm256_set1_ps(p[r * pstride]), vv, _mm256_loadu_ps(out + r * D + d)));
  }
}
}  // namespace

// One layer's decode attention for B sequences, one query token each: q [B, H, R, D] (the R
// query heads sharing each of the H KV heads), k and v [H, S, D] (the layer's pool of S slots),
// sequence b attending to its first lens[b] tokens, token l in slot
// blocks[b, l / bs] * bs + l % bs. -> [B, H, R, D]. Scores by the dot kernel, softmax by torch's
// (vectorized) kernel over [B, H, R, max len] with -inf padding, then the probability-weighted
// sum of V rows; each block's rows are read in place, in order.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& blocks, const torch::Tensor& lens, int64_t bs,
                               double scale, int64_t isa) {
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
  const bool avx512 = use_avx512(isa, "decode_attention");
  const int64_t NB = blocks.size(1);
  const int64_t* bt = blocks.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  int64_t lmax = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ln[b] >= 1 && (ln[b] + bs - 1) / bs <= NB, "decode_attention: slots out of the pool");
    for (int64_t j = 0; j < (ln[b] + bs - 1) / bs; ++j) {
      const int64_t blk = bt[b * NB + j];
      TORCH_CHECK(blk >= 0 && (blk + 1) * bs <= S, "decode_attention: slots out of the pool");
    }
    lmax = std::max(lmax, ln[b]);
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
      float* srow = sp + bh * R * lmax;
      for (int64_t l0 = 0; l0 < ln[b]; l0 += bs) {
        const float* kb = kp + (h * S + bt[b * NB + l0 / bs] * bs) * D;
        for (int64_t i = 0; i < std::min(bs, ln[b] - l0); ++i)
          for (int64_t r = 0; r < R; ++r) {
            const float* qr = qp + (bh * R + r) * D;
            srow[r * lmax + l0 + i] = sc * (avx512 ? dot512(qr, kb + i * D, D) : dot256(qr, kb + i * D, D));
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
      const float* prow = pp + bh * R * lmax;
      float* orow = op + bh * R * D;
      for (int64_t l0 = 0; l0 < ln[b]; l0 += bs) {
        const float* vb = vp + (h * S + bt[b * NB + l0 / bs] * bs) * D;
        for (int64_t i = 0; i < std::min(bs, ln[b] - l0); ++i) {
          if (avx512) axpy512(prow + l0 + i, lmax, R, vb + i * D, orow, D);
          else axpy256(prow + l0 + i, lmax, R, vb + i * D, orow, D);
        }
      }
    }
  });
  return out;
}

bool has_avx512() { return __builtin_cpu_supports("avx512f"); }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// x [M, K] fp32 contiguous, w [N/16, K, 16] fp32 contiguous -> [M, N]; isa 0 auto, 1 avx2, 2 avx512
torch::Tensor panel_mm(const torch::Tensor& x, const torch::Tensor& w, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == P, "panel_mm: bad shapes");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "panel_mm: fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "panel_mm: contiguous tensors only");
  TORCH_CHECK(x.size(1) == w.size(1), "panel_mm: inner sizes differ");
  const bool avx512 = use_avx512(isa, "panel_mm");
  const int64_t rows = x.size(0), K = x.size(1), n_panels = w.size(0), N = n_panels * P;
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
        panels<2>(avx512, xp, rows, K, wp + 2 * g * K * P, K, op + 2 * g * P, N);
    });
    if (n_panels % 2)
      panels<1>(avx512, xp, rows, K, wp + (n_panels - 1) * K * P, K, op + (n_panels - 1) * P, N);
  }
  return out;
}
"""

_lock = threading.Lock()
_module: Any = None
_tried = False
_isa = ISA_AVX2  # the ISA panel_mm uses by default (set when the module loads)


def _build() -> Any:
    from torch.utils import cpp_extension

    try:  # torch's builder runs `ninja` from PATH; the pip package puts it next to Python
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    return cpp_extension.load_inline(
        name="pdserve_cpu_kernels_v2",
        cpp_sources=_SOURCE,
        functions=["panel_mm", "decode_attention", "has_avx512", "has_avx2"],
        extra_cflags=["-O3"],
        verbose=False,
    )


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


def panels_of(weight: torch.Tensor) -> torch.Tensor | None:
    """W [N, K] as [N/16, K, 16] (panel j: output features 16j..16j+15, K-major), or None where the
    kernel does not apply (not fp32, N not a multiple of 16, kernel unavailable)."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or n % PANEL or weight.device.type != "cpu" or not available():
        return None
    return weight.detach().view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def decode_attention(
    q: torch.Tensor,  # [B, H, R, D]: each sequence's query token, R query heads per KV head
    k: torch.Tensor,  # [H, S, D]: the layer's K pool (S slots = blocks x block_size)
    v: torch.Tensor,  # [H, S, D]
    blocks: torch.Tensor,  # [B, max blocks] int64: each sequence's block table (padding unread)
    lens: torch.Tensor,  # [B] int64: its context length (tokens)
    block_size: int,  # tokens per block
    scale: float,
    isa: int | None = None,
) -> torch.Tensor:
    """One layer's decode attention for every sequence in one call, reading each sequence's
    blocks in place -> [B, H, R, D] (fp32, D a multiple of 16)."""
    mod = _load()
    assert mod is not None, "decode_attention without the kernels (check available() first)"
    chosen = _isa if isa is None else isa
    return mod.decode_attention(q.contiguous(), k, v, blocks, lens, block_size, scale, chosen)


def panel_mm(x: torch.Tensor, panels: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """x [M, K] times the panelled weight -> [M, N] (= x W^T), fp32; isa: unless given, AVX-512
    where the CPU has it and torch's CPU capability includes it, else AVX2 (ISA_AUTO: the best
    the CPU has)."""
    mod = _load()
    assert mod is not None, "panel_mm without the kernel (check available() first)"
    return mod.panel_mm(x.contiguous(), panels, _isa if isa is None else isa)
