// CPU kernels for the fp32 engine. Paged attention for decode: each query row attends to its request's keys and values where
// they lie in the block pool, so the gathered [B, L, H_kv, D] copy the torch backend makes is never
// built. Also the KV write (one call for K and V), the small-batch linear, RMSNorm (with the residual
// add), RoPE, SiLU-mul, and decode_layers: a small step's whole layer stack in one call. fp32 only
// (the CPU path's dtype).
//
// Cache views are [num_blocks, block_size, H_kv, D] with the inner three dims contiguous and any
// stride between blocks (a layer's K or V slice of the pool's [N, L, 2, bs, H_kv, D] tensor).

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  // 32 independent partial sums (four 8-wide vectors, so FMA latency is hidden), in a fixed order:
  // vectorised without -ffast-math.
  float acc[32] = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
#pragma GCC unroll 32
    for (int j = 0; j < 32; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (; i + 8 <= n; i += 8) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = (acc[j] + acc[j + 8]) + (acc[j + 16] + acc[j + 24]);
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// f(state, begin, end) over [0, n) in chunks the threads take as they finish the last: when one core
// is slower (a busy neighbour, an interrupt) or items differ in cost (requests of different lengths),
// the others take more, where at::parallel_for's equal split would wait on the slowest. Each thread
// has one State for the call (scratch space, freed when the call returns).
struct NoState {};
template <typename State = NoState, typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk), 1, [&](int64_t, int64_t) {
    State state{};
    for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk)) f(state, b, std::min(n, b + chunk));
  });
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// A vector register of floats (GCC vector extensions: zmm with AVX-512, ymm with AVX2; the FMAs
// come from -ffp-contract=fast).
#if defined(__AVX512F__)
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif
typedef float vf __attribute__((vector_size(VL * sizeof(float))));

inline vf loadu(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

inline float hsum(vf v) {  // halves added pairwise in registers, in a fixed order
#if defined(__AVX512F__)
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vf8 a = v;
#endif
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

void check_cache(const at::Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 4 && c.scalar_type() == at::kFloat && c.device().is_cpu(),
              name, " must be a [N, block_size, H_kv, D] float32 CPU tensor");
  TORCH_CHECK(c.stride(3) == 1 && c.stride(2) == c.size(3) && c.stride(1) == c.size(2) * c.size(3),
              name, ": each block's [block_size, H_kv, D] must be contiguous");
}

typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

inline vf vsplat(float a) { return vf{} + a; }

// exp(x) for x <= 0 (softmax after the max shift), a vector at a time: Cody-Waite range reduction
// and Cephes' expf polynomial (relative error ~1e-7); below -87 (and -inf) it returns 0 as expf
// underflows. n is rounded to nearest by adding and subtracting 1.5 * 2^23 (exact for |n| <= 126):
// a scalar version's std::floor compiled to one scalar vrndscaless per element.
inline vf exp_nonpositive(vf x) {
  const vi under = x < vsplat(-87.0f);
  const vf xc = under ? vsplat(-87.0f) : x;
  const vf magic = vsplat(12582912.0f);
  const vf n = (xc * 1.44269504088896341f + magic) - magic;
  const vf r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  vf p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf e = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return under ? vsplat(0.0f) : e * scale;
}

// x * sigmoid(x) = x / (1 + exp(-x)), written with e = exp(-|x|) <= 1 so the exp never overflows:
// x / (1 + e) for x >= 0, x * e / (1 + e) below.
inline vf silu(vf x) {
  const vi neg = x < vsplat(0.0f);
  const vf e = exp_nonpositive(neg ? x : -x);
  return (neg ? x * e : x) / (e + 1.0f);
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < VL; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// Ask for `rows` rows of `d` floats, `stride` floats apart, ahead of their loads.
inline void prefetch_rows(const float* p, int64_t rows, int64_t stride, int64_t d) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(p + r * stride + i);
}


// out[g] = sum over the context's tokens t of s[g][t] * v_t, for GB query heads of one KV head
// (`voff`: its offset in a token's row), each output kept in NV vector registers across every token,
// so a value row is loaded once for the GB heads and the outputs are stored once. Tokens are added
// in order, as the axpy loop does (the same sums).
template <int NV, int GB>
void pv_rows(const float* vp, int64_t v_stride, const int32_t* table, int64_t L, int64_t bs, int64_t tok,
             int64_t voff, const float* const* s, float* const* out) {
  vf acc[GB][NV] = {};
  const int64_t nblk = (L + bs - 1) / bs;
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const float* vb = vp + table[blk] * v_stride + voff;
    if (blk + 1 < nblk) prefetch_rows(vp + table[blk + 1] * v_stride + voff, bs, tok, NV * VL);
    const int64_t t0 = blk * bs, rows = std::min(bs, L - t0);
    for (int64_t r = 0; r < rows; ++r) {
      vf v[NV];
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) v[i] = loadu(vb + r * tok + i * VL);
#pragma GCC unroll 8
      for (int g = 0; g < GB; ++g) {
        const vf w = vsplat(s[g][t0 + r]);
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) acc[g][i] += w * v[i];
      }
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NV; ++i) storeu(out[g] + i * VL, acc[g][i]);
}

using PvFn = void (*)(const float*, int64_t, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                      const float* const*, float* const*);

// The register-blocked PV for head size D and up to `g` heads at once, or null (D not a multiple of
// the vector width, or too wide): (function, heads it takes). Accumulators take at most half the
// vector registers (32 with AVX-512, 16 with AVX2), at most 4 heads at once.
std::pair<PvFn, int> pv_kernel(int64_t D, int64_t g) {
  constexpr int64_t budget = VL == 16 ? 16 : 8;
  if (D % VL != 0 || D / VL > budget) return {nullptr, 0};
  const int64_t nv = D / VL;
  const int64_t gb = std::min({g, budget / nv, int64_t{4}});
#define PV_CASE(NV_, GB_) if (nv == NV_ && gb == GB_) return {&pv_rows<NV_, GB_>, GB_};
  PV_CASE(1, 1) PV_CASE(1, 2) PV_CASE(1, 3) PV_CASE(1, 4)
  PV_CASE(2, 1) PV_CASE(2, 2) PV_CASE(2, 3) PV_CASE(2, 4)
  PV_CASE(4, 1) PV_CASE(4, 2) PV_CASE(4, 3) PV_CASE(4, 4)
  PV_CASE(8, 1) PV_CASE(8, 2)
  PV_CASE(16, 1)
#undef PV_CASE
  return {nullptr, 0};
}

#if defined(__AVX512F__)
// 16 accumulators -> one vector whose lane j is the sum of acc[j]'s lanes: a tree of two-source
// shuffles (46 operations, against 16 horizontal sums of about 7 each).
inline vf reduce16(const vf* acc) {
  vf v1[8], v2[4], v3[2];
  for (int m = 0; m < 8; ++m) {
    const vf a = acc[2 * m], b = acc[2 * m + 1];
    v1[m] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int n = 0; n < 4; ++n) {
    const vf c = v1[2 * n], d = v1[2 * n + 1];
    v2[n] = __builtin_shufflevector(c, d, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            __builtin_shufflevector(c, d, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int p = 0; p < 2; ++p) {
    const vf e = v2[2 * p], f = v2[2 * p + 1];
    v3[p] = __builtin_shufflevector(e, f, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
            __builtin_shufflevector(e, f, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  const vf v4 = __builtin_shufflevector(v3[0], v3[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                __builtin_shufflevector(v3[0], v3[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // lane i holds token [0,8,4,12,2,10,6,14,1,9,5,13,3,11,7,15][i]: the bit reversal, its own inverse
  return __builtin_shufflevector(v4, v4, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#endif

// q: [B, H, D]; block_tables: [B, max_blocks] int32; seq_lens: [B] int32 -> out [B, H, D].
// window > 0 (a sliding layer): a row of length L sees positions L - window .. L - 1 only; the
// blocks before the one holding L - window are never read.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t window = 0) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be [B, H, D] float32");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  const auto qc = q.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "head shapes do not match");
  TORCH_CHECK(tables.size(0) == B && lens.size(0) == B, "one block table and length per row");
  const int64_t G = H / Hkv, max_blocks = tables.size(1);
  const int64_t k_stride = k_cache.stride(0), v_stride = v_cache.stride(0), tok = Hkv * D;
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const float* qp = qc.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * bs, "seq_lens[", b, "] = ", lp[b], " is out of range");
  }
  auto out = at::zeros({B, H, D}, qc.options());
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // One work item is a request's KV heads [h0, h0 + nh) and their nh * G query heads, which read
  // each key and value once. With enough requests for the threads an item is a whole request (its
  // token rows read front to back); with few, one KV head (more items than threads).
  const int64_t nh = B >= 4 * at::get_num_threads() ? Hkv : 1, QH = nh * G;
  const auto pv = pv_kernel(D, G);
  parallel_chunks<std::vector<float>>(B * (Hkv / nh), 1, [&](std::vector<float>& scores, int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (Hkv / nh), h0 = item % (Hkv / nh) * nh;
      // A window starts the row at the block holding its first key (table and length shifted by
      // whole blocks); the keys before it in that block are masked below (skip of them).
      const int64_t first = window > 0 ? std::max<int64_t>(lp[b] - window, 0) / bs : 0;
      const int64_t L = lp[b] - first * bs;
      const int64_t skip = window > 0 ? std::max<int64_t>(L - window, 0) : 0;
      const int32_t* table = tp + b * max_blocks + first;
      scores.resize(static_cast<size_t>(QH * L));
      float* sc = scores.data();
      const float* qrow = qp + (b * H + h0 * G) * D;
      // scores[j, t] = q_j . k_t * scale (j: the item's query heads, k_t of j's KV head): one vector
      // accumulator per dot, reduced in registers. Block by block (no division per token); the next
      // block's rows of the item's heads are fetched ahead.
      const int64_t nblk = (L + bs - 1) / bs;
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const float* kb = kp + table[blk] * k_stride + h0 * D;
        if (blk + 1 < nblk) prefetch_rows(kp + table[blk + 1] * k_stride + h0 * D, bs, tok, nh * D);
        const int64_t t0 = blk * bs, rows = std::min(bs, L - t0);
        int64_t r = 0;
#if defined(__AVX512F__)
        // 16 token rows at a time: one accumulator per token, reduced together
        for (; D % VL == 0 && r + 16 <= rows; r += 16) {
          for (int64_t jq = 0; jq < QH; ++jq) {
            const float* k = kb + r * tok + (jq / G) * D;
            const float* qj = qrow + jq * D;
            vf acc[16] = {};
            for (int64_t i = 0; i < D; i += VL) {
              const vf qv = loadu(qj + i);
#pragma GCC unroll 16
              for (int j = 0; j < 16; ++j) acc[j] += qv * loadu(k + j * tok + i);
            }
            storeu(sc + jq * L + t0 + r, reduce16(acc) * fscale);
          }
        }
#endif
        for (; r < rows; ++r) {
          for (int64_t jq = 0; jq < QH; ++jq) {
            const float* k = kb + r * tok + (jq / G) * D;
            const float* qj = qrow + jq * D;
            vf acc = {};
            int64_t i = 0;
            for (; i + VL <= D; i += VL) acc += loadu(qj + i) * loadu(k + i);
            float dot_qk = hsum(acc);
            for (; i < D; ++i) dot_qk += qj[i] * k[i];
            sc[jq * L + t0 + r] = dot_qk * fscale;
          }
        }
      }
      // softmax of each query head's row, VL lanes at a time
      for (int64_t jq = 0; jq < QH; ++jq) {
        float* s = sc + jq * L;
        for (int64_t t = 0; t < skip; ++t) s[t] = -std::numeric_limits<float>::infinity();
        vf mv = vsplat(-std::numeric_limits<float>::infinity());
        int64_t t = 0;
        for (; t + VL <= L; t += VL) {
          const vf x = loadu(s + t);
          mv = x > mv ? x : mv;
        }
        float m = hmax(mv);
        for (; t < L; ++t) m = std::max(m, s[t]);
        const vf mm = vsplat(m);
        vf sv = {};
        for (t = 0; t + VL <= L; t += VL) {
          const vf e = exp_nonpositive(loadu(s + t) - mm);
          storeu(s + t, e);
          sv += e;
        }
        if (t < L) {  // the last L % VL scores, the other lanes -inf (their exp is 0)
          vf x = vsplat(-std::numeric_limits<float>::infinity());
          for (int64_t i = 0; t + i < L; ++i) x[i] = s[t + i] - m;
          const vf e = exp_nonpositive(x);
          for (int64_t i = 0; t + i < L; ++i) s[t + i] = e[i];
          sv += e;
        }
        const float sum = hsum(sv);
        const vf inv = vsplat(1.0f / sum);
        for (t = 0; t + VL <= L; t += VL) storeu(s + t, loadu(s + t) * inv);
        for (; t < L; ++t) s[t] *= inv[0];
      }
      float* orow = op + (b * H + h0 * G) * D;
      if (pv.first != nullptr) {
        for (int64_t hh = 0; hh < nh; ++hh) {
          for (int64_t g0 = 0; g0 < G; g0 += pv.second) {
            const int64_t n = std::min<int64_t>(pv.second, G - g0);
            const float* srows[16];
            float* orows[16];
            for (int64_t g = 0; g < n; ++g) {
              srows[g] = sc + (hh * G + g0 + g) * L;
              orows[g] = orow + (hh * G + g0 + g) * D;
            }
            (n == pv.second ? pv.first : pv_kernel(D, n).first)(vp, v_stride, table, L, bs, tok, (h0 + hh) * D, srows, orows);
          }
        }
        continue;
      }
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const float* vb = vp + table[blk] * v_stride + h0 * D;
        if (blk + 1 < nblk) prefetch_rows(vp + table[blk + 1] * v_stride + h0 * D, bs, tok, nh * D);
        const int64_t t0 = blk * bs, rows = std::min(bs, L - t0);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t jq = 0; jq < QH; ++jq) axpy(orow + jq * D, sc[jq * L + t0 + r], vb + r * tok + (jq / G) * D, D);
        }
      }
    }
  });
  return out;
}

// k, v: [T, H_kv, D] -> stored at (slot_blocks[t], slot_offsets[t]) of k_cache / v_cache.
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong,
              "slots must be int64");
  const auto kc = k.contiguous(), vc = v.contiguous();
  const int64_t T = kc.size(0), tok = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(kc.numel() == T * tok && vc.numel() == T * tok && slot_blocks.numel() == T &&
              slot_offsets.numel() == T, "one slot per token, [T, H_kv, D] each");
  const int64_t N = k_cache.size(0), bs = k_cache.size(1);
  const int64_t* sb = slot_blocks.data_ptr<int64_t>();
  const int64_t* so = slot_offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sb[t] >= 0 && sb[t] < N && so[t] >= 0 && so[t] < bs, "slot ", t, " is out of range");
  }
  float* kd = k_cache.data_ptr<float>();
  float* vd = v_cache.data_ptr<float>();
  const float* ks = kc.data_ptr<float>();
  const float* vs = vc.data_ptr<float>();
  const int64_t k_stride = k_cache.stride(0), v_stride = v_cache.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    std::copy(ks + t * tok, ks + (t + 1) * tok, kd + sb[t] * k_stride + so[t] * tok);
    std::copy(vs + t * tok, vs + (t + 1) * tok, vd + sb[t] * v_stride + so[t] * tok);
  }
}


// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for the few rows of a decode step (x: [M, K] contiguous,
// w: [N, K] with its rows ldw >= K floats apart). One pass over w, the bytes that bound a decode step:
// each thread takes tiles of weight rows and multiplies every row of x against a tile while it sits in
// cache. Up to DOT_ROWS rows the step is memory-bound and each weight row is dotted with each x row
// (fewer live registers, more loads in flight). Past that the FMA units bound it: rows of x go in
// blocks of 2 * VL (or VL) through linear_cols, vectorised along the rows, and the last few rows (at
// most DOT_TAIL) through TM x TN dot-product tiles. One step's linears of the 50M benchmark model, 2
// threads, the AVX-512 VM (2026-11-26, dot tiles only -> with linear_cols): 16 rows 90 -> 103-125
// GFLOP/s, 32 rows 117-127 -> 141-152, 64 rows 134-153 -> 152-170 (torch's 2048^3 matmul: 165-190).
constexpr int64_t DOT_ROWS = 4, DOT_TAIL = 8;
#if defined(__AVX512F__)
constexpr int TM = 4, TN = 4;  // 16 accumulators + 4 weight vectors + 1 x vector of 32 registers
constexpr int COLS_NR = 12;    // linear_cols: 24 accumulators + 2 x vectors + 1 broadcast
#else
constexpr int TM = 2, TN = 4;  // 8 + 4 + 1 of 16
constexpr int COLS_NR = 4;     // 8 + 2 + 1
#endif
static_assert(COLS_NR % TN == 0, "a linear_cols tile is whole dot tiles for the last rows");

template <int MR, int NR>
inline void linear_tile(const float* __restrict x, int64_t K, const float* __restrict w, int64_t ldw,
                        float* __restrict y, int64_t N, const float* bias) {
  vf acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = vf{};
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    vf wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) wv[j] = loadu(w + j * ldw + k);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const vf xv = loadu(x + i * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];  // an FMA (-ffp-contract=fast)
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) s += x[i * K + kk] * w[j * ldw + kk];
      y[i * N + j] = bias ? s + bias[j] : s;
    }
}

template <int NR, int R>
inline void linear_tail(int64_t rows, const float* x, int64_t K, const float* w, int64_t ldw, float* y, int64_t N,
                        const float* bias) {
  if constexpr (R >= 1) {
    if (rows == R) linear_tile<R, NR>(x, K, w, ldw, y, N, bias);
    else linear_tail<NR, R - 1>(rows, x, K, w, ldw, y, N, bias);
  }
}

// Every row of x against NR weight rows: TM rows at a time, then the rest.
template <int NR>
inline void linear_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t ldw, float* y, int64_t N,
                        const float* bias) {
  int64_t m = 0;
  for (; m + TM <= M; m += TM) linear_tile<TM, NR>(x + m * K, K, w, ldw, y + m * N, N, bias);
  linear_tail<NR, TM - 1>(M - m, x + m * K, K, w, ldw, y + m * N, N, bias);
}

// x transposed, [K, MV * VL] per block of rows (zero-padded), against NR weight rows: for each k one
// vector load gives MV * VL rows' x[m, k] and each w[n, k] is a broadcast FMA operand. MV * NR
// accumulators, MV loads and NR broadcasts per k, no horizontal sums. Each lane sums COLS_KC
// products in order, then adds that partial sum to the lane's total (kept in memory: the registers
// are the accumulators'): the rounding error grows with K / COLS_KC + COLS_KC, not with K.
constexpr int64_t COLS_KC = 64;

template <int MV, int NR>
inline void linear_cols(const float* __restrict xt, int64_t K, const float* __restrict w, int64_t ldw,
                        float* __restrict y, int64_t rows, int64_t N, const float* bias) {
  vf total[MV][NR] = {};
  for (int64_t k0 = 0; k0 < K; k0 += COLS_KC) {
    const int64_t k1 = std::min(K, k0 + COLS_KC);
    vf acc[MV][NR];
#pragma GCC unroll 16
    for (int i = 0; i < MV; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[i][j] = vf{};
    for (int64_t k = k0; k < k1; ++k) {
      vf xv[MV];
#pragma GCC unroll 16
      for (int i = 0; i < MV; ++i) xv[i] = loadu(xt + k * (MV * VL) + i * VL);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) {
        const float b = w[j * ldw + k];
#pragma GCC unroll 16
        for (int i = 0; i < MV; ++i) acc[i][j] += xv[i] * b;  // an FMA with a broadcast operand
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MV; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) total[i][j] += acc[i][j];
  }
  for (int i = 0; i < MV; ++i)
    for (int j = 0; j < NR; ++j) {
      const float bj = bias ? bias[j] : 0.0f;
      for (int64_t l = 0; l < VL && i * VL + l < rows; ++l) y[(i * VL + l) * N + j] = total[i][j][l] + bj;
    }
}

template <int MV, int R>
inline void linear_cols_tail(int64_t nr, const float* xt, int64_t K, const float* w, int64_t ldw, float* y,
                             int64_t rows, int64_t N, const float* bias) {
  if constexpr (R >= 1) {
    if (nr == R) linear_cols<MV, R>(xt, K, w, ldw, y, rows, N, bias);
    else linear_cols_tail<MV, R - 1>(nr, xt, K, w, ldw, y, rows, N, bias);
  }
}

template <int MV>
inline void linear_cols_any(int64_t nr, const float* xt, int64_t K, const float* w, int64_t ldw, float* y,
                            int64_t rows, int64_t N, const float* bias) {
  if (nr == COLS_NR) linear_cols<MV, COLS_NR>(xt, K, w, ldw, y, rows, N, bias);
  else linear_cols_tail<MV, COLS_NR - 1>(nr, xt, K, w, ldw, y, rows, N, bias);
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  const auto xc = x.contiguous();
  // Weight rows may lie further apart than K (CPUKernelOps.place_weight pads them; see there).
  const auto wc = w.stride(1) == 1 && w.stride(0) >= w.size(1) ? w : w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0), ldw = wc.stride(0);
  auto y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == N, "bias [N]");
    bp = bc.data_ptr<float>();
  }
  if (M <= DOT_ROWS) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const float* wr = wp + n * ldw;
        for (int64_t m = 0; m < M; ++m) {
          const float v = dot(xp + m * K, wr, K);
          yp[m * N + n] = bp ? v + bp[n] : v;
        }
      }
    });
    return y;
  }
  // Blocks of rows: 2 * VL while more than 1.5 * VL rows are left (the last padded), VL while more than
  // DOT_TAIL are, then the rest by dot tiles. Each block's x is transposed once, zero-padded.
  struct Block { int64_t row, mv, off; };
  std::vector<Block> blocks;
  int64_t m = 0, off = 0;
  for (int64_t left = M; left > DOT_TAIL; left = M - m) {
    const int64_t mv = 2 * left > 3 * VL ? 2 : 1;
    blocks.push_back({m, mv, off});
    off += K * mv * VL;
    m = std::min(M, m + mv * VL);
  }
  const int64_t dot_row = m;
  std::vector<float> xt(off, 0.0f);
  for (const Block& b : blocks) {
    const int64_t width = b.mv * VL, rows = std::min(width, M - b.row);
    float* d = xt.data() + b.off;
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = xp + (b.row + r) * K;
      for (int64_t k = 0; k < K; ++k) d[k * width + r] = src[k];
    }
  }
  parallel_chunks((N + COLS_NR - 1) / COLS_NR, 1, [&](NoState&, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * COLS_NR, nr = std::min<int64_t>(COLS_NR, N - n);
      const float* wt = wp + n * ldw;
      const float* bt = bp ? bp + n : nullptr;
      for (const Block& b : blocks) {
        float* yb = yp + b.row * N + n;
        if (b.mv == 2) linear_cols_any<2>(nr, xt.data() + b.off, K, wt, ldw, yb, M - b.row, N, bt);
        else linear_cols_any<1>(nr, xt.data() + b.off, K, wt, ldw, yb, M - b.row, N, bt);
      }
      if (dot_row == M) continue;
      const float* xd = xp + dot_row * K;
      float* yd = yp + dot_row * N;
      int64_t j = 0;
      for (; j + TN <= nr; j += TN) linear_rows<TN>(xd, M - dot_row, K, wt + j * ldw, ldw, yd + n + j, N, bt ? bt + j : nullptr);
      for (; j < nr; ++j) linear_rows<1>(xd, M - dot_row, K, wt + j * ldw, ldw, yd + n + j, N, bt ? bt + j : nullptr);
    }
  });
  return y;
}

// One row of C: out = r / sqrt(mean(r^2) + eps) * w.
inline void rms_norm_row(const float* r, const float* w, float* out, int64_t C, double eps) {
  const float inv = 1.0f / std::sqrt(dot(r, r, C) / static_cast<float>(C) + static_cast<float>(eps));
  for (int64_t c = 0; c < C; ++c) out[c] = (r[c] * inv) * w[c];
}

// out = rms_norm(x) * w over the last dim; x: [T, C] contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.numel() == x.size(1), "x [T, C] float32, w [C]");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const int64_t T = xc.size(0), C = xc.size(1);
  auto out = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(xp + t * C, wp, op + t * C, C, eps);
  });
  return out;
}


// residual += x (in place), then out = rms_norm(residual) * w: a decoder layer's residual add and
// the next norm in one pass. x, residual: [T, C] contiguous.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && residual.is_contiguous() &&
              x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat && w.numel() == x.size(1),
              "x and residual [T, C] float32 (residual contiguous), w [C]");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const int64_t T = xc.size(0), C = xc.size(1);
  auto out = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = rp + t * C;
      for (int64_t c = 0; c < C; ++c) r[c] += xp[t * C + c];
      rms_norm_row(r, wp, op + t * C, C, eps);
    }
  });
  return out;
}


// Rotate-half RoPE in place: x[t, h, :] = x * cos[t] + swap_halves(x) * signed_sin[t], where
// signed_sin has its first half negated. x: [T, H, D] with each head's D contiguous (any row
// and head strides: a view into the fused qkv output); cos, signed_sin: [T, D] (any leading shape).
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "x [T, H, D] float32, D contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const auto cc = cos.contiguous(), sc = signed_sin.contiguous();
  TORCH_CHECK(D % 2 == 0 && cc.numel() == T * D && sc.numel() == T * D, "cos and sin [T, D]");
  float* xp = x.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) {
        float* r = xp + t * st + h * sh;
        for (int64_t i = 0; i < half; ++i) {
          const float a = r[i], b = r[i + half];
          r[i] = a * c[i] + b * s[i];
          r[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// silu(gate) * up from the fused gate_up output [T, 2I] -> [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.size(1) % 2 == 0,
              "gate_up [T, 2I] float32");
  const auto g = gate_up.contiguous();
  const int64_t T = g.size(0), I = g.size(1) / 2;
  auto out = at::empty({T, I}, g.options());
  const float* gp = g.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = gp + t * 2 * I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + VL <= I; i += VL) storeu(o + i, silu(loadu(row + i)) * loadu(row + I + i));
      if (i < I) {  // the last I % VL, through the same vector code
        vf a{}, b{};
        std::memcpy(&a, row + i, (I - i) * sizeof(float));
        std::memcpy(&b, row + I + i, (I - i) * sizeof(float));
        const vf r = silu(a) * b;
        std::memcpy(o + i, &r, (I - i) * sizeof(float));
      }
    }
  });
  return out;
}

// A decode-only step's whole layer stack in one call: per layer the ops the model runs with these
// kernels (model/llama.py: norm, fused qkv, RoPE, KV write, attention, o_proj, norm, gate_up, SiLU-mul,
// down), attention by paged_decode, and no Python between them (at one stream the ~14 op dispatches a
// layer cost about as much as the layer's non-linear work). x: [T, C] the embeddings (T decode rows);
// weights: 6 per layer [input_norm, qkv, o, post_attention_norm, gate_up, down]; qkv_bias: none or one
// per layer; kv_cache: [num_blocks, L, 2, block_size, H_kv, D]; cos, signed_sin: [T, D]. Returns
// (x, residual) after the last layer: the final norm of their sum is the model's.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x0, at::TensorList weights, at::TensorList qkv_bias, const at::Tensor& kv_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& slot_blocks,
    const at::Tensor& slot_offsets, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t num_heads,
    int64_t num_kv_heads, double eps, double scale) {
  TORCH_CHECK(kv_cache.dim() == 6 && x0.dim() == 2, "kv_cache [N, L, 2, bs, H_kv, D], x [T, C]");
  const int64_t L = kv_cache.size(1), D = kv_cache.size(5), T = x0.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * L, "6 weights per layer");
  TORCH_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == L, "no qkv bias or one per layer");
  TORCH_CHECK(kv_cache.size(4) == num_kv_heads, "kv heads");
  const int64_t qk = (num_heads + num_kv_heads) * D;
  at::Tensor x = x0, residual = x0;
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + 6 * i;
    at::Tensor h = i == 0 ? rms_norm(x, w[0], eps) : add_rms_norm(x, residual, w[0], eps);
    const at::Tensor qkv = small_linear(h, w[1], qkv_bias.empty() ? c10::optional<at::Tensor>() : qkv_bias[i]);
    const at::Tensor qkh = qkv.narrow(1, 0, qk).view({T, num_heads + num_kv_heads, D});
    rope_(qkh, cos, signed_sin);
    const at::Tensor layer = kv_cache.select(1, i);
    const at::Tensor k_cache = layer.select(1, 0), v_cache = layer.select(1, 1);
    write_kv(k_cache, v_cache, qkh.narrow(1, num_heads, num_kv_heads),
             qkv.narrow(1, qk, num_kv_heads * D).view({T, num_kv_heads, D}), slot_blocks, slot_offsets);
    const at::Tensor o = paged_decode(qkh.narrow(1, 0, num_heads), k_cache, v_cache, block_tables, seq_lens, scale);
    h = add_rms_norm(small_linear(o.view({T, num_heads * D}), w[2], c10::nullopt), residual, w[3], eps);
    x = small_linear(silu_mul(small_linear(h, w[4], c10::nullopt)), w[5], c10::nullopt);
  }
  return {x, residual};
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int window=0) -> Tensor");
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor w, float eps) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor[] weights, Tensor[] qkv_bias, Tensor(a!) kv_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor slot_blocks, Tensor slot_offsets, Tensor cos, Tensor signed_sin, int num_heads, "
        "int num_kv_heads, float eps, float scale) -> (Tensor, Tensor)");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_blocks, Tensor slot_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("write_kv", &write_kv);
  m.impl("small_linear", &small_linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_layers", &decode_layers);
}
