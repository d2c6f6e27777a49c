// The sampler's row sums in one fixed order: the same bits whatever the thread count and the CPU.
//
// torch's sum over a row splits a long row (more than its 32,768-element grain) across threads
// when it has few rows to share out -- a decode step of one sequence over a 49,152-token
// vocabulary sums differently on one thread than on two -- and its vector width follows the CPU.
// Here each row is summed by one thread, into 8 double accumulators (element i into i % 8),
// combined in a fixed tree, then the tail: a function of the row alone.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>

// x [R, V] float32, contiguous -> [R, 1] float32.
at::Tensor row_sum(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "row_sum takes a contiguous float32 [R, V] tensor");
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor out = at::empty({rows, 1}, x.options());
  const float* in = x.data_ptr<float>();
  float* sums = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* p = in + r * cols;
      double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= cols; i += 8) {
        for (int k = 0; k < 8; ++k) acc[k] += static_cast<double>(p[i + k]);
      }
      double tail = 0;
      for (; i < cols; ++i) tail += static_cast<double>(p[i]);
      const double body = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
                          ((acc[2] + acc[6]) + (acc[3] + acc[7]));
      sums[r] = static_cast<float>(body + tail);
    }
  });
  return out;
}
