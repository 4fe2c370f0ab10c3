// Grouped LoRA on the CPU (conveyor_kernels/lora.py, `lora_add_cpu`): each token row adds its own adapter slot's low-rank
// term to the base projection's output in one call, out[t] += (x[t] . A[s]^T) . B_t[s], s = slots[t] (-1: none).
// One pass per row: the row widened to float32 once, the shrink's dot products over the slot's used rank rows only
// (`used`: zero-padded ranks and untargeted parts skipped), the expand of each rank row over its own part's output
// columns only (B is block-diagonal over the fused parts), accumulated in float32 and added to `out` with one
// rounding, as torch's addmm rounds. Rows are visited grouped by slot (a stable counting sort), so a slot's
// weights stay in cache across the rows that use it even when a step interleaves 16 or more adapters.
// pybind11 and its Tensor conversions only: torch/extension.h adds the whole C++ frontend (torch/all.h), which
// nothing here uses and which took two thirds of this file's compile time.
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float widen(float value) { return value; }
inline float widen(at::BFloat16 value) {
  uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}
inline void narrow(float value, float* out) { *out = value; }
inline void narrow(float value, at::BFloat16* out) { *out = at::BFloat16(value); }  // round to nearest even

// The rows that have a slot, grouped by slot in their order within each (a stable counting sort).
std::vector<int64_t> rows_by_slot(const int32_t* slot_data, int64_t rows, int64_t num_slots) {
  std::vector<int64_t> starts(num_slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slot_data[t] < num_slots, "a row names slot ", slot_data[t], " of ", num_slots);
    if (slot_data[t] >= 0) ++starts[slot_data[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) starts[s + 1] += starts[s];
  std::vector<int64_t> order(starts[num_slots]);
  for (int64_t t = 0; t < rows; ++t)
    if (slot_data[t] >= 0) order[starts[slot_data[t]]++] = t;
  return order;
}

template <typename T>
void lora_rows(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t, const at::Tensor& slots,
               const at::Tensor& used, const std::vector<int64_t>& part_starts, int64_t part_rank, at::Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), width = a.size(1), columns = out.size(1);
  const T* x_data = x.data_ptr<T>();
  const T* a_data = a.data_ptr<T>();
  const T* b_data = b_t.data_ptr<T>();
  const int32_t* slot_data = slots.data_ptr<int32_t>();
  const bool* used_data = used.data_ptr<bool>();
  T* out_data = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const std::vector<int64_t> order = rows_by_slot(slot_data, rows, a.size(0));
  // about 64k multiply-adds a row in SmolLM2's shapes: a few rows per task
  at::parallel_for(0, static_cast<int64_t>(order.size()), 4, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in), y(width), acc(columns);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = order[i];
      const int32_t slot = slot_data[t];
      const T* x_row = x_data + t * x_stride;
      for (int64_t k = 0; k < in; ++k) xf[k] = widen(x_row[k]);
      const bool* slot_used = used_data + slot * width;
      const T* a_slot = a_data + slot * width * in;
      for (int64_t r = 0; r < width; ++r) {
        if (!slot_used[r]) continue;
        const T* a_row = a_slot + r * in;
        float sum = 0.f;
        for (int64_t k = 0; k < in; ++k) sum += xf[k] * widen(a_row[k]);
        y[r] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const T* b_slot = b_data + slot * width * columns;
      for (int64_t r = 0; r < width; ++r) {
        if (!slot_used[r]) continue;
        const int64_t part = r / part_rank, first = part_starts[part], last = part_starts[part + 1];
        const T* b_row = b_slot + r * columns;
        const float scale = y[r];
        for (int64_t n = first; n < last; ++n) acc[n] += scale * widen(b_row[n]);
      }
      T* out_row = out_data + t * out_stride;
      for (int64_t n = 0; n < columns; ++n) narrow(widen(out_row[n]) + acc[n], out_row + n);
    }
  });
}

}  // namespace

// x [T, in], a [slots, W, in], b_t [slots, W, out] (W = parts * part_rank, contiguous), slots [T] int32, used
// [slots, W] bool (which rank rows a slot's adapter fills), part_starts: the parts' first output columns and the
// end (parts + 1 values), out [T, out] (rows may be strided, columns contiguous): updated in place.
void lora_add(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t, const at::Tensor& slots,
              const at::Tensor& used, const std::vector<int64_t>& part_starts, int64_t part_rank, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && b_t.dim() == 3 && out.dim() == 2, "x, out 2-D; A, B_t 3-D");
  TORCH_CHECK(a.is_contiguous() && b_t.is_contiguous() && used.is_contiguous() && slots.is_contiguous(),
              "A, B_t, used and slots must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "the columns of x and out must be contiguous");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && a.scalar_type() == b_t.scalar_type() &&
              b_t.scalar_type() == out.scalar_type(), "x, A, B_t and out must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kInt && used.scalar_type() == at::kBool, "slots int32, used bool");
  const int64_t width = a.size(1);
  TORCH_CHECK(x.size(1) == a.size(2) && b_t.size(1) == width && b_t.size(2) == out.size(1) &&
              out.size(0) == x.size(0) && slots.size(0) == x.size(0) && used.size(0) == a.size(0) &&
              used.size(1) == width && a.size(0) == b_t.size(0), "shapes of x, A, B_t, slots, used, out disagree");
  TORCH_CHECK(part_rank > 0 && width % part_rank == 0 &&
              static_cast<int64_t>(part_starts.size()) == width / part_rank + 1 && part_starts.back() == out.size(1),
              "part_starts must give each part's first output column and the end");
  if (x.scalar_type() == at::kFloat) {
    lora_rows<float>(x, a, b_t, slots, used, part_starts, part_rank, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    lora_rows<at::BFloat16>(x, a, b_t, slots, used, part_starts, part_rank, out);
  } else {
    TORCH_CHECK(false, "lora_add on the CPU takes float32 or bfloat16");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_add", &lora_add, "grouped LoRA shrink and expand per row, added to out in place");
}
