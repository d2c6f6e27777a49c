// Structured outputs: set to -inf every logit a row's grammar does not allow, reading the grammar
// engine's bitmask (one bit per token, 1 = allowed; llguidance's layout) as it is.
//
// The Python path unpacked the bitmask into one byte per token and ran masked_fill: at batch 64
// over a 49,152-token vocabulary that is 3 M bytes written, read back and 3 M floats compared --
// several milliseconds of a decode step. Here a word of 32 allowed tokens (all bits set) is
// skipped, one of 32 banned ones filled at once, and the others clear only the banned logits. Rows are split over torch's intra-op
// threads (the engine's own thread count).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

// logits [B, V] float32, contiguous; bitmask [R, W] int32 with W * 32 >= V; rows [R] int64:
// row rows[i] of logits takes bitmask row i. In place.
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous float32 [B, V] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [R, W] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "rows must be a contiguous int64 [R] tensor");
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  const int64_t num_rows = rows.size(0), words = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == num_rows, "one bitmask row per entry of rows");
  TORCH_CHECK(words * 32 >= vocab, "the bitmask covers fewer tokens than the vocabulary");
  const int64_t* index = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_rows; ++i) {
    TORCH_CHECK(index[i] >= 0 && index[i] < batch, "row index out of range");
  }
  float* out = logits.data_ptr<float>();
  const auto* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float banned = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = out + index[i] * vocab;
      const uint32_t* mask = bits + i * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = mask[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, n = std::min<int64_t>(32, vocab - base);
        if (word == 0) {  // the common word of a tight grammar: all 32 banned
          std::fill(row + base, row + base + n, banned);
          continue;
        }
        for (int64_t b = 0; b < n; ++b) {  // a select, not a branch: it vectorizes
          row[base + b] = ((word >> b) & 1u) ? row[base + b] : banned;
        }
      }
    }
  });
}
