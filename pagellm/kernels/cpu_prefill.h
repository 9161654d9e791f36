// The shared driver of the prefill attention kernels (cpu_prefill.cpp: AMX; cpu_prefill_vec.cpp:
// AVX-512), and the bfloat16 K/V packing both use.
//
// A step's prefill chunks are attended in two parallel phases: first the K/V of every sequence
// (its context and its own new rows, already in the cache) are gathered from the blocks into a
// packed layout of the kernel's choosing, one unit of kKeyBlock keys per kv head and work item,
// keys past the context zero; then each (sequence, kv head, 16 query rows) item runs every query
// head of the group over the units its last row may see, longest rows first.
//
// A full unit (every key below its sequence's context) holds exactly the K/V of the cache blocks
// it spans, so sequences whose block tables share those blocks (prefix-cache hits: 64 prompts
// of one 1,024-token prefix each attending to it) share one packed copy: the shared prefix is
// packed once per step, not once per sequence, and the attend phase reads one copy that stays in
// cache. The partial last unit (zeros past the context) is always its sequence's own.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "cpu_common.h"

namespace pagellm {

struct PrefillSeq {
  int64_t q_row;       // first query row in q / out
  int64_t q_len;       // new rows of this chunk
  int64_t ctx;         // tokens in the cache after this chunk (context + q_len)
  int64_t bt_row;      // row of block_tables
  int64_t first_unit;  // its units' entries in the driver's unit table
};

// Where one sequence's packed K/V of one kv head lie for the attend phase: unit j (keys
// [j kKeyBlock, (j + 1) kKeyBlock)) has its K at k(j) and its V at v(j), kKeyBlock * D
// elements each.
template <typename T>
struct PackedKV {
  const T* base;           // the workspace, offset to the kv head
  const int64_t* offsets;  // the sequence's units' offsets (elements) from base
  int64_t v_offset;        // V after K within a unit
  const T* k(int64_t j) const { return base + offsets[j]; }
  const T* v(int64_t j) const { return base + offsets[j] + v_offset; }
};

// The C entry point's arguments (pagellm_prefill_attention).
struct PrefillArgs {
  void* out;
  int64_t out_stride;
  const void* q;
  int64_t q_stride;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  int64_t bt_stride;
  int64_t num_seqs;
  const int64_t* q_rows;
  const int32_t* q_lens;
  const int32_t* ctx_lens;
  const int64_t* bt_rows;
  int64_t H, Hkv, D, block_size;
  float scale;
};

// A token's K/V row in the cache: [block][slot][kv head][D].
template <typename T>
inline const T* cache_row(const T* cache, const int32_t* bt, int64_t tok, int64_t block_size,
                          int64_t Hkv, int64_t D, int64_t h) {
  const int64_t block = bt[tok / block_size];
  return cache + ((block * block_size + tok % block_size) * Hkv + h) * D;
}

#if defined(__AVX512F__)
// K of keys [k0, k0 + 16) with the dims outermost: for each 64 bytes of a K row (32 bfloat16
// = 16 dim pairs, or 16 float32 dims), 16 rows of 64 bytes, row i holding pair (dim) i of the
// 16 keys: in bfloat16 the VNNI layout of a dot-product operand. Keys at or past ctx are 0.
template <typename T>
inline void pack_k_lanes(T* dst, const T* k_cache, const int32_t* bt, int64_t k0, int64_t ctx,
                         int64_t block_size, int64_t Hkv, int64_t D, int64_t h) {
  constexpr int64_t W = 64 / sizeof(T);  // elements per 64 bytes
  __m512i r[16];
  for (int64_t c = 0; c < D / W; ++c) {
    for (int64_t n = 0; n < 16; ++n) {
      const int64_t tok = k0 + n;
      r[n] = tok < ctx ? _mm512_loadu_si512(cache_row(k_cache, bt, tok, block_size, Hkv, D, h) +
                                            c * W)
                       : _mm512_setzero_si512();
    }
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (c * 16 + i) * W, r[i]);
  }
}

// bfloat16 V of keys [k0, k0 + 32) as D/16 groups of [16 key pairs][16 dims][2]; keys past ctx
// are 0.
inline void pack_v_bf16(uint16_t* dst, const uint16_t* v_cache, const int32_t* bt, int64_t k0,
                        int64_t ctx, int64_t block_size, int64_t Hkv, int64_t D, int64_t h) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t p = 0; p < 16; ++p) {
    const int64_t t0 = k0 + 2 * p, t1 = t0 + 1;
    const uint16_t* r0 = t0 < ctx ? cache_row(v_cache, bt, t0, block_size, Hkv, D, h) : nullptr;
    const uint16_t* r1 = t1 < ctx ? cache_row(v_cache, bt, t1, block_size, Hkv, D, h) : nullptr;
    for (int64_t dd = 0; dd < D / 16; ++dd) {
      const __m256i a = r0 ? _mm256_loadu_si256((const __m256i*)(r0 + dd * 16)) : zero;
      const __m256i b = r1 ? _mm256_loadu_si256((const __m256i*)(r1 + dd * 16)) : zero;
      const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      _mm512_storeu_si512(dst + dd * 512 + p * 32, pair);
    }
  }
}
#endif

// Runs the two phases with kernel K, which provides:
//   using T;                               the element type
//   static constexpr int64_t kKeyBlock;    keys per unit (also the attend loop's key step)
//   struct Thread;                         per-thread state of the attend phase (e.g. tiles)
//   static void pack(const PrefillArgs&, const PrefillSeq&, T* kt, T* vt, int64_t k0, int64_t h)
//       packs keys [k0, k0 + kKeyBlock) of kv head h at kt (K) and vt (V), kKeyBlock * D
//       elements each;
//   static void attend(const PrefillArgs&, const PrefillSeq&, const PackedKV<T>&, int64_t r0,
//                      int64_t h)
//       query rows [r0, r0 + 16) of the sequence, every head of kv head h's group.
template <typename K>
void run_prefill(const PrefillArgs& a) {
  using T = typename K::T;
  constexpr int64_t KB = K::kKeyBlock;
  const int64_t D = a.D, Hkv = a.Hkv, bs = a.block_size;
  const int64_t unit_elems = 2 * KB * D;  // K then V of one kv head
  std::vector<PrefillSeq> seqs(a.num_seqs);
  int64_t num_entries = 0;
  for (int64_t i = 0; i < a.num_seqs; ++i) {
    seqs[i] = PrefillSeq{a.q_rows[i], a.q_lens[i], a.ctx_lens[i], a.bt_rows[i], num_entries};
    num_entries += (a.ctx_lens[i] + KB - 1) / KB;
  }
  // Every sequence's units: a full unit is keyed by the last cache block it spans and its first
  // key's offset in its first block, and taken from the first sequence that has it when the
  // blocks it spans are the same ones (with prefix caching a shared block's predecessors are
  // shared too, so that check only fails on tables that are not prefix-cache chains).
  std::vector<int64_t> unit_index(num_entries);   // entry -> packed unit
  std::vector<int64_t> pack_items;                // packed unit -> (seq << 40) | entry's j
  std::unordered_map<uint64_t, int64_t> shared;   // (last block, offset) -> entry
  shared.reserve(static_cast<size_t>(num_entries));
  for (int64_t i = 0; i < a.num_seqs; ++i) {
    const PrefillSeq& s = seqs[i];
    const int32_t* bt = a.block_tables + s.bt_row * a.bt_stride;
    for (int64_t j = 0, n = (s.ctx + KB - 1) / KB; j < n; ++j) {
      const int64_t entry = s.first_unit + j;
      if ((j + 1) * KB <= s.ctx) {
        const int64_t first = j * KB / bs, last = ((j + 1) * KB - 1) / bs;
        const uint64_t key = (static_cast<uint64_t>(bt[last]) << 32) |
                             static_cast<uint64_t>(j * KB % bs);
        const auto [it, inserted] = shared.try_emplace(key, entry);
        if (!inserted) {
          const int64_t other = it->second;
          const int64_t oi = pack_items[unit_index[other]] >> 40;
          const int64_t oj = other - seqs[oi].first_unit;
          const int32_t* obt = a.block_tables + seqs[oi].bt_row * a.bt_stride + oj * KB / bs;
          if (std::equal(bt + first, bt + last + 1, obt)) {
            unit_index[entry] = unit_index[other];
            continue;
          }
        }
      }
      unit_index[entry] = static_cast<int64_t>(pack_items.size());
      pack_items.push_back((i << 40) | j);
    }
  }
  const int64_t num_units = static_cast<int64_t>(pack_items.size());
  const int64_t total = num_units * unit_elems * Hkv;
  static thread_local std::vector<T> ws;
  if (ws.size() < static_cast<size_t>(total)) ws.resize(total);
  T* packed = ws.data();
  // Kv head h's units lie in its own slab of the workspace, unit_elems apart; an entry's offset
  // is its unit's place in the slab.
  std::vector<int64_t> offsets(num_entries);
  for (int64_t e = 0; e < num_entries; ++e) offsets[e] = unit_index[e] * unit_elems;
  // Attend items: sequence * 2^40 + kv head * 2^32 + block of 16 query rows.
  std::vector<int64_t> attend_items;
  for (int64_t i = 0; i < a.num_seqs; ++i)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t b = 0; b < (seqs[i].q_len + 15) / 16; ++b)
        attend_items.push_back((i << 40) | (h << 32) | b);
  // Longest rows first: late rows of a long chunk see the most keys.
  std::sort(attend_items.begin(), attend_items.end(), [&](int64_t x, int64_t y) {
    const PrefillSeq& sx = seqs[x >> 40];
    const PrefillSeq& sy = seqs[y >> 40];
    return sx.ctx - sx.q_len + (x & 0xffffffff) * 16 > sy.ctx - sy.q_len + (y & 0xffffffff) * 16;
  });
  const int64_t slab = num_units * unit_elems;  // one kv head's units
  const int64_t n_pack = num_units * Hkv, n_attend = attend_items.size();
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < n_pack; ++it) {
      const int64_t u = it / Hkv, h = it % Hkv;
      const PrefillSeq& s = seqs[pack_items[u] >> 40];
      const int64_t j = pack_items[u] & 0xffffffffff;
      T* kt = packed + h * slab + u * unit_elems;
      K::pack(a, s, kt, kt + KB * D, j * KB, h);
    }
    [[maybe_unused]] typename K::Thread thread_state;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_attend; ++it) {
      const PrefillSeq& s = seqs[attend_items[it] >> 40];
      const int64_t h = (attend_items[it] >> 32) & 0xff, b = attend_items[it] & 0xffffffff;
      const PackedKV<T> kv{packed + h * slab, offsets.data() + s.first_unit, KB * D};
      K::attend(a, s, kv, b * 16, h);
    }
  }
}

// The AVX-512 kernels (cpu_prefill_vec.cpp): dtype 0 = float32, 1 = bfloat16 (AVX512-BF16).
bool prefill_vec_supported(int dtype, int64_t head_dim);
void prefill_attention_vec(int dtype, const PrefillArgs& a);

}  // namespace pagellm
