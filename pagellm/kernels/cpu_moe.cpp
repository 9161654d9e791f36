// Mixture-of-Experts MLP in one call: out[t] = sum over t's top-k experts e (ascending e) of
// w[t, e] * down_e(SiLU(gate_e(x[t])) * up_e(x[t])), with AVX-512 vectors (bfloat16 with
// AVX512-BF16 dot products, float32 with FMAs), on expert weights packed once at load time.
//
// Packed layouts (cpu_moe.py builds them), both the size of the plain stacks, of the activations'
// dtype or of int8 codes in the same element order (weight-only int8: per-output scales, applied
// to the sums):
// - gate/up of one expert, [I/16 pairs][K steps][gate 16 x per][up 16 x per]: pair block p holds
//   the gate and up rows [16 p, 16 p + 16) interleaved step by step, so one pair (the 16 SiLU
//   outputs it makes) is read as one sequential stream;
// - down of one expert, linear_pack's layout (cpu_linear_vec.cpp): blocks of 16 of its H outputs,
//   each [I steps][16 x per].
// (per = elements a lane holds: 2 bfloat16, 1 float32; a step covers per input dims.)
//
// The call: (1) sort the (token, k) assignments by expert, tokens ascending within an expert (a
// counting sort: no per-expert round trip to Python); (2) every thread takes its share of the
// gate/up pair blocks of every active expert and writes SiLU(gate) * up for the expert's rows into
// an activation buffer (the SiLU on the accumulators, never stored before it); (3) after a barrier,
// every thread takes its share of the H output blocks and, expert by expert in ascending order,
// multiplies the expert's activation rows by its down blocks and adds the rows, scaled by their
// routing weights, straight into float32 output rows: a token's experts are added in ascending
// order whatever the thread count (transformers' order), and no thread writes another's columns.
// Splitting both phases by output columns keeps both threads streaming when most experts get one
// to four rows (decode). Each thread prefetches its next panel (often the next expert's, where the
// hardware prefetchers lose the stream) while it multiplies the current one.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_moe_formats.h"

namespace pagellm {
namespace {

#if defined(__AVX512F__)
constexpr int64_t kRowChunk = 256;  // rows kept in cache while a thread's weight panels stream

// Cache lines of the next panel to prefetch, spread over the k steps of the current one.
struct Prefetch {
  const char* at = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;  // lines per k step

  inline void step() {
    for (int64_t l = 0; l < per_step && at < end; ++l, at += 64) __builtin_prefetch(at, 0, 2);
  }
};

inline Prefetch prefetch_of(const void* next, int64_t bytes, int64_t steps) {
  if (next == nullptr || bytes <= 0) return {};
  const char* p = static_cast<const char*>(next);
  return {p, p + bytes, (bytes / 64 + steps - 1) / steps};
}

inline __m512 silu16(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

// Gate/up: MR rows (pointers) x NP pair blocks from `w` (consecutive). act rows get the 16 NP
// SiLU(gate) * up values of pairs [p, p + NP) at columns 16 p (gate outputs 16 p.., up outputs
// I + 16 p.. of the expert's 2I).
template <typename T, typename W, int MR, int NP>
inline void gate_up_micro(T* const* act, const T* const* x, const typename Fmt<T, W>::Store* w,
                          int64_t K, int64_t I, int64_t p, ExpertQuant q, Prefetch pf) {
  using Ops = VecOps<T>;
  using F = Fmt<T, W>;
  __m512 g[MR][NP], u[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) g[i][j] = u[i][j] = _mm512_setzero_ps();
  const int64_t pair = 2 * F::kStep * (K / F::kDims);  // stored values per pair block
  __m512 sg[NP], mg[NP], su[NP], mu[NP];
  for (int j = 0; j < NP; ++j) sg[j] = mg[j] = su[j] = mu[j] = _mm512_setzero_ps();
  for (int64_t k = 0, s = 0; k < K; k += F::kDims, ++s) {
    if constexpr (F::kGrouped) {
      if (k % q.group == 0)
        for (int j = 0; j < NP; ++j) {
          q.group_of(k, (p + j) * 16, sg[j], mg[j]);
          q.group_of(k, I + (p + j) * 16, su[j], mu[j]);
        }
    }
    pf.step();
    __m512 wg[NP][F::kVecs], wu[NP][F::kVecs];
    for (int j = 0; j < NP; ++j) {
      F::load(w + j * pair + s * 2 * F::kStep, wg[j], sg[j], mg[j]);
      F::load(w + j * pair + s * 2 * F::kStep + F::kStep, wu[j], su[j], mu[j]);
    }
    for (int v = 0; v < F::kVecs; ++v)
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = Ops::bcast(x[i] + k + v * Ops::kPer);
        for (int j = 0; j < NP; ++j) {
          g[i][j] = Ops::madd(g[i][j], wg[j][v], xv);
          u[i][j] = Ops::madd(u[i][j], wu[j][v], xv);
        }
      }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t n = (p + j) * 16;
    __m512 cg = _mm512_set1_ps(1.0f), cu = cg;
    if constexpr (F::kRowScales) {
      cg = load16(q.rows + n);
      cu = load16(q.rows + I + n);
    }
    for (int i = 0; i < MR; ++i)
      store16(act[i] + n, _mm512_mul_ps(silu16(_mm512_mul_ps(g[i][j], cg)),
                                        _mm512_mul_ps(u[i][j], cu)));
  }
}

// Down: MR activation rows x NB blocks of 16 outputs from block nb (consecutive at `w`); row i
// adds scale[i] * its products into out rows orow[i] (float32) at columns 16 nb.
template <typename T, typename W, int MR, int NB>
inline void down_micro(float* const* orow, const float* scale, const T* const* a,
                       const typename Fmt<T, W>::Store* w, int64_t I, int64_t nb, ExpertQuant q,
                       Prefetch pf) {
  using Ops = VecOps<T>;
  using F = Fmt<T, W>;
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t block = F::kStep * (I / F::kDims);
  __m512 gs[NB], gm[NB];
  for (int j = 0; j < NB; ++j) gs[j] = gm[j] = _mm512_setzero_ps();
  for (int64_t k = 0, s = 0; k < I; k += F::kDims, ++s) {
    if constexpr (F::kGrouped) {
      if (k % q.group == 0)
        for (int j = 0; j < NB; ++j) q.group_of(k, (nb + j) * 16, gs[j], gm[j]);
    }
    pf.step();
    __m512 wv[NB][F::kVecs];
    for (int j = 0; j < NB; ++j) F::load(w + j * block + s * F::kStep, wv[j], gs[j], gm[j]);
    for (int v = 0; v < F::kVecs; ++v)
      for (int i = 0; i < MR; ++i) {
        const __m512 av = Ops::bcast(a[i] + k + v * Ops::kPer);
        for (int j = 0; j < NB; ++j) acc[i][j] = Ops::madd(acc[i][j], wv[j][v], av);
      }
  }
  for (int j = 0; j < NB; ++j) {
    __m512 c = _mm512_set1_ps(1.0f);
    if constexpr (F::kRowScales) c = load16(q.rows + (nb + j) * 16);
    for (int i = 0; i < MR; ++i) {
      float* o = orow[i] + (nb + j) * 16;
      const __m512 s = _mm512_mul_ps(_mm512_set1_ps(scale[i]), c);
      _mm512_storeu_ps(o, _mm512_fmadd_ps(acc[i][j], s, _mm512_loadu_ps(o)));
    }
  }
}

// rows [0, n) of a panel in groups of up to kMax rows: fn(first row, an integral_constant of the
// group's rows, prefetch), the whole prefetch riding on the last group. Group sizes above kMax
// are never instantiated (a format with fewer registers to spare caps them).
template <int kMax, typename Fn>
inline void row_groups(int64_t n, Prefetch pf, Fn&& fn) {
  using std::integral_constant;
  for (int64_t i = 0; i < n; i += kMax) {
    const int64_t m = std::min<int64_t>(kMax, n - i);
    const Prefetch part = i + m < n ? Prefetch{} : pf;
    switch (m) {
      case 6: if constexpr (kMax >= 6) fn(i, integral_constant<int, 6>{}, part); break;
      case 5: if constexpr (kMax >= 5) fn(i, integral_constant<int, 5>{}, part); break;
      case 4: if constexpr (kMax >= 4) fn(i, integral_constant<int, 4>{}, part); break;
      case 3: if constexpr (kMax >= 3) fn(i, integral_constant<int, 3>{}, part); break;
      case 2: if constexpr (kMax >= 2) fn(i, integral_constant<int, 2>{}, part); break;
      default: fn(i, integral_constant<int, 1>{}, part); break;
    }
  }
}

// A thread's panels: per active expert, its own range [b0, b1) of blocks in steps of up to
// `width` blocks (a pair block counts as one); (expert index, first block, blocks) in order.
struct Panel {
  int64_t slot, b, n;
};

std::vector<Panel> panels_of(const std::vector<int64_t>& active, int64_t b0, int64_t b1,
                             int64_t width) {
  std::vector<Panel> out;
  for (int64_t s = 0; s < static_cast<int64_t>(active.size()); ++s)
    for (int64_t b = b0; b < b1; b += width) out.push_back({s, b, std::min(width, b1 - b)});
  return out;
}

// One thread's panels over a stack (`blocks` blocks of `block_len` stored values per expert):
// fn(panel, expert, its weights, first row, rows, prefetch) for every chunk of kRowChunk rows of
// the panel's expert (rows [start[e], start[e + 1])), the last chunk prefetching the next
// panel's weights (often the next expert's) over its `steps` k steps.
template <typename S, typename Fn>
void run_panels(const std::vector<Panel>& panels, const std::vector<int64_t>& active,
                const std::vector<int64_t>& start, const S* stack, int64_t blocks,
                int64_t block_len, int64_t steps, Fn&& fn) {
  auto at = [&](const Panel& pn) { return stack + (active[pn.slot] * blocks + pn.b) * block_len; };
  for (size_t c = 0; c < panels.size(); ++c) {
    const Panel& pn = panels[c];
    const int64_t e = active[pn.slot], r0 = start[e], n = start[e + 1] - r0;
    Prefetch pf;
    if (c + 1 < panels.size()) {
      const Panel& d = panels[c + 1];
      pf = prefetch_of(at(d), d.n * block_len * static_cast<int64_t>(sizeof(S)), steps);
    }
    for (int64_t m = 0; m < n; m += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, n - m);
      fn(pn, e, at(pn), r0 + m, rows, m + rows < n ? Prefetch{} : pf);
    }
  }
}

// w13 / w2: the packed stacks in format W (Fmt); qd: their quantization data.
template <typename T, typename W>
void moe_forward(T* out, int64_t ldo, const T* x, int64_t ldx, const int64_t* ids,
                 const float* topw, const void* w13v, const void* w2v, const QuantData& qd,
                 int64_t Tn, int64_t top_k, int64_t E, int64_t H, int64_t I, float* out32) {
  using F = Fmt<T, W>;
  using S = typename F::Store;
  const S* w13 = static_cast<const S*>(w13v);
  const S* w2 = static_cast<const S*>(w2v);
  // (1) Assignments by expert, tokens ascending within each (a stable counting sort).
  const int64_t R = Tn * top_k;
  std::vector<int64_t> start(E + 1, 0), fill;
  for (int64_t r = 0; r < R; ++r) ++start[ids[r] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  fill.assign(start.begin(), start.end() - 1);
  std::vector<int64_t> token(R);
  std::vector<float> scale(R);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t at = fill[ids[r]]++;
    token[at] = r / top_k;
    scale[at] = topw[r];
  }
  std::vector<int64_t> active;  // experts with rows, ascending
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);

  static thread_local std::vector<T> act_buf;
  if (act_buf.size() < static_cast<size_t>(R * I)) act_buf.resize(R * I);
  T* act = act_buf.data();
  std::vector<const T*> xrow(R);
  std::vector<T*> actrow(R);
  std::vector<float*> orow(R);
  constexpr bool f32_out = std::is_same<T, float>::value;
  float* acc_out = f32_out ? reinterpret_cast<float*>(out) : out32;
  const int64_t ldacc = f32_out ? ldo : H;
  for (int64_t r = 0; r < R; ++r) {
    xrow[r] = x + token[r] * ldx;
    actrow[r] = act + r * I;
    orow[r] = acc_out + token[r] * ldacc;
  }
  const int64_t P = I / 16, NB = H / 16;
  const int64_t steps_h = H / F::kDims, steps_i = I / F::kDims;
  const int64_t pair_len = 2 * F::kStep * steps_h, block_len = F::kStep * steps_i;
  auto quant13 = [&](int64_t e) {
    return ExpertQuant{qd.rs13 ? qd.rs13 + e * 2 * I : nullptr,
                       qd.sz13 ? qd.sz13 + e * H * 2 * I * 2 / qd.group : nullptr, 2 * I,
                       qd.group};
  };
  auto quant2 = [&](int64_t e) {
    return ExpertQuant{qd.rs2 ? qd.rs2 + e * H : nullptr,
                       qd.sz2 ? qd.sz2 + e * I * H * 2 / qd.group : nullptr, H, qd.group};
  };

#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    // (2) Gate/up: pair blocks [p0, p1) of every active expert, two pairs a panel.
    const int64_t p0 = P * t / nt, p1 = P * (t + 1) / nt;
    run_panels(panels_of(active, p0, p1, 2), active, start, w13, P, pair_len, steps_h,
               [&](const Panel& pn, int64_t e, const S* w, int64_t r, int64_t rows, Prefetch pf) {
      const ExpertQuant q = quant13(e);
      row_groups<F::kMaxRows>(rows, pf, [&](int64_t i, auto mr, Prefetch part) {
        constexpr int MR = decltype(mr)::value;
        T* const* a = &actrow[r + i];
        const T* const* xr = &xrow[r + i];
        if (pn.n == 2) gate_up_micro<T, W, MR, 2>(a, xr, w, H, I, pn.b, q, part);
        else gate_up_micro<T, W, MR, 1>(a, xr, w, H, I, pn.b, q, part);
      });
    });
    // (3) Down: output blocks [n0, n1) of every token, experts in ascending order.
    const int64_t n0 = NB * t / nt, n1 = NB * (t + 1) / nt;
    for (int64_t tok = 0; tok < Tn; ++tok)
      std::fill(acc_out + tok * ldacc + n0 * 16, acc_out + tok * ldacc + n1 * 16, 0.0f);
#pragma omp barrier
    run_panels(panels_of(active, n0, n1, 3), active, start, w2, NB, block_len, steps_i,
               [&](const Panel& pn, int64_t e, const S* w, int64_t r, int64_t rows, Prefetch pf) {
      const ExpertQuant q = quant2(e);
      row_groups<F::kMaxRows>(rows, pf, [&](int64_t i, auto mr, Prefetch part) {
        constexpr int MR = decltype(mr)::value;
        float* const* o = &orow[r + i];
        const float* sc = &scale[r + i];
        const T* const* a = &actrow[r + i];
        if (pn.n == 3) down_micro<T, W, MR, 3>(o, sc, a, w, I, pn.b, q, part);
        else if (pn.n == 2) down_micro<T, W, MR, 2>(o, sc, a, w, I, pn.b, q, part);
        else down_micro<T, W, MR, 1>(o, sc, a, w, I, pn.b, q, part);
      });
    });
    if constexpr (!f32_out) {
      // Round this thread's columns once (nothing else writes them).
      for (int64_t tok = 0; tok < Tn; ++tok)
        for (int64_t b = n0; b < n1; ++b)
          store16(out + tok * ldo + b * 16, _mm512_loadu_ps(out32 + tok * H + b * 16));
    }
  }
}
#endif  // __AVX512F__

// Whether the kernel takes this dtype (0 = float32, 1 = bfloat16) and experts of hidden size H
// and width I here: both multiples of 16, AVX-512 (and AVX512-BF16 for bfloat16).
int moe_available(int dtype, int64_t H, int64_t I) {
  if (H <= 0 || I <= 0 || H % 16 != 0 || I % 16 != 0) return 0;
#if defined(__AVX512F__)
  if (dtype == 0) return 1;
#if defined(__AVX512BF16__)
  if (dtype == 1) return 1;
#endif
#endif
  return 0;
}

// The call with weights in format W: the activations' own dtype (Plain), int8 codes or Int4.
struct Plain {};

template <typename W>
int moe_call(int dtype, void* out, int64_t ldo, const void* x, int64_t ldx, const int64_t* ids,
             const float* topw, const void* w13, const void* w2, const QuantData& qd, int64_t T,
             int64_t top_k, int64_t E, int64_t H, int64_t I) {
#if defined(__AVX512F__)
  if (dtype == 0) {
    using WF = typename std::conditional<std::is_same<W, Plain>::value, float, W>::type;
    moe_forward<float, WF>(static_cast<float*>(out), ldo, static_cast<const float*>(x), ldx,
                           ids, topw, w13, w2, qd, T, top_k, E, H, I, nullptr);
    return 1;
  }
#if defined(__AVX512BF16__)
  if (dtype == 1) {
    static thread_local std::vector<float> out32;
    if (out32.size() < static_cast<size_t>(T * H)) out32.resize(T * H);
    using WB = typename std::conditional<std::is_same<W, Plain>::value, uint16_t, W>::type;
    moe_forward<uint16_t, WB>(static_cast<uint16_t*>(out), ldo, static_cast<const uint16_t*>(x),
                              ldx, ids, topw, w13, w2, qd, T, top_k, E, H, I, out32.data());
    return 1;
  }
#endif
#endif
  (void)dtype; (void)out; (void)ldo; (void)x; (void)ldx; (void)ids; (void)topw; (void)w13;
  (void)w2; (void)qd; (void)T; (void)top_k; (void)E; (void)H; (void)I;
  return 0;
}

// Checks shared by the entry points: 1 go on, 0 refused, kOutOfBounds an id outside [0, E).
int moe_check(int dtype, const int64_t* ids, int64_t T, int64_t top_k, int64_t E, int64_t H,
              int64_t I) {
  if (!moe_available(dtype, H, I) || T < 0 || top_k <= 0 || E <= 0) return 0;
  for (int64_t r = 0; r < T * top_k; ++r)
    if (ids[r] < 0 || ids[r] >= E) return kOutOfBounds;
  return 1;
}

}  // namespace
}  // namespace pagellm

extern "C" {

// Whether pagellm_moe_forward(_int8, _int4) takes this dtype (0 = float32, 1 = bfloat16) and
// experts of hidden size H and width I here (moe_available).
int pagellm_moe_available(int dtype, int64_t H, int64_t I) {
  return pagellm::moe_available(dtype, H, I);
}

// out [T, H] (row stride ldo) = the MoE MLP of x [T, H] (row stride ldx): ids [T, top_k] int64
// expert ids, topw [T, top_k] float32 routing weights, w13 / w2 the packed stacks (see the top
// of the file) of E experts; all of the dtype. Returns 1 done; 0 refused (nothing done):
// pagellm_moe_available is 0; kOutOfBounds: an expert id outside [0, E) (nothing done).
int pagellm_moe_forward(int dtype, void* out, int64_t ldo, const void* x, int64_t ldx,
                        const int64_t* ids, const float* topw, const void* w13, const void* w2,
                        int64_t T, int64_t top_k, int64_t E, int64_t H, int64_t I) {
  using namespace pagellm;
  const int ok = moe_check(dtype, ids, T, top_k, E, H, I);
  if (ok != 1 || T == 0) return ok;
  return moe_call<Plain>(dtype, out, ldo, x, ldx, ids, topw, w13, w2, QuantData{}, T, top_k, E,
                         H, I);
}

// The same with int8 expert codes (packed in the element order of the activations' dtype) and
// their bfloat16 per-output scales s13 [E, 2I] (gate rows, then up rows) and s2 [E, H].
int pagellm_moe_forward_int8(int dtype, void* out, int64_t ldo, const void* x, int64_t ldx,
                             const int64_t* ids, const float* topw, const void* w13,
                             const void* w2, const void* s13, const void* s2, int64_t T,
                             int64_t top_k, int64_t E, int64_t H, int64_t I) {
  using namespace pagellm;
  const int ok = moe_check(dtype, ids, T, top_k, E, H, I);
  if (ok != 1 || T == 0) return ok;
  QuantData qd;
  qd.rs13 = static_cast<const uint16_t*>(s13);
  qd.rs2 = static_cast<const uint16_t*>(s2);
  return moe_call<int8_t>(dtype, out, ldo, x, ldx, ids, topw, w13, w2, qd, T, top_k, E, H, I);
}

// The same with int4 codes (two per byte, see Fmt<T, Int4>) and bfloat16 (scale, zero) pairs per
// group of `group` input dims and output: sz13 [E, H/group, 2I, 2], sz2 [E, I/group, H, 2]; the
// weight is (code - 8) * scale + zero. group must divide H and I and be even.
int pagellm_moe_forward_int4(int dtype, void* out, int64_t ldo, const void* x, int64_t ldx,
                             const int64_t* ids, const float* topw, const void* w13,
                             const void* w2, const void* sz13, const void* sz2, int64_t group,
                             int64_t T, int64_t top_k, int64_t E, int64_t H, int64_t I) {
  using namespace pagellm;
  if (group <= 0 || group % 2 != 0 || H % group != 0 || I % group != 0) return 0;
  const int ok = moe_check(dtype, ids, T, top_k, E, H, I);
  if (ok != 1 || T == 0) return ok;
  QuantData qd;
  qd.sz13 = static_cast<const uint16_t*>(sz13);
  qd.sz2 = static_cast<const uint16_t*>(sz2);
  qd.group = group;
  return moe_call<Int4>(dtype, out, ldo, x, ldx, ids, topw, w13, w2, qd, T, top_k, E, H, I);
}

}  // extern "C"
