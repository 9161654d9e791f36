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

}  // namespace pagellm
#endif
