// AMX tiles for the CPU kernels: permission and a scoped tile configuration.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGELLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagellm {

// Linux hands the AMX tile state only to processes that ask for it (oneDNN asks too).
inline bool amx_permitted() {
  static const bool ok =
      syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..7 as 16 rows x 64 bytes for this scope; the caller's configuration (oneDNN's, or
// none) is put back at its end.
class FullTiles {
 public:
  FullTiles() {
    _tile_storeconfig(&saved_);
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
  }
  ~FullTiles() { _tile_loadconfig(&saved_); }
  FullTiles(const FullTiles&) = delete;
  FullTiles& operator=(const FullTiles&) = delete;

 private:
  TileConfig saved_;
};

// Transposes 16 x 16 32-bit elements held as 16 rows in place: rows of 16 bf16 pairs become
// the VNNI layout of a B tile (pair r of every row in tile row r), and back for float32 tiles.
inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i u0 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0x88);
    const __m512i u1 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0xDD);
    const __m512i v0 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0xDD);
    r[q] = _mm512_shuffle_i32x4(u0, v0, 0x88);
    r[4 + q] = _mm512_shuffle_i32x4(u1, v1, 0x88);
    r[8 + q] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
    r[12 + q] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
  }
}

}  // namespace pagellm
#endif
