// AMX tiles, shared by the GEMM kernels that run them (invariant_linear's tiles layout,
// int8_linear's amx path): Linux's leave to use the tile state, and the one tile shape they
// use. engine/kernels.py puts this text ahead of a kernel's own (KERNEL_HEADERS), so a change
// here rebuilds them.

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && \
    (__GNUC__ >= 11 || defined(__clang__))
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#define TANDEM_AMX 1

namespace tandem_amx {

// Whether this process may use the tile state: Linux grants it per process, on request (asked
// once; the CPU's own AMX features are the caller's to check).
inline bool granted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // asm/prctl.h, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// The tile registers' shapes, as ldtilecfg reads them (palette 1).
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0..tmm6 as 16 rows x 64 bytes, the shape both kernels use: 4 accumulators, 1 x tile, 2
// weight tiles. Per thread, before its first tile instruction.
__attribute__((target("amx-tile"))) inline void configure() {
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) inline void release() { _tile_release(); }

}  // namespace tandem_amx
#endif
