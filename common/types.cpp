#include "kiln/types.h"

#include <algorithm>

namespace kiln {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::u8: return "u8";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view n) {
  if (n == "f32" || n == "float32") return DType::f32;
  if (n == "f16" || n == "float16") return DType::f16;
  if (n == "bf16" || n == "bfloat16") return DType::bf16;
  if (n == "u8" || n == "uint8") return DType::u8;
  if (n == "i32" || n == "int32") return DType::i32;
  if (n == "i64" || n == "int64") return DType::i64;
  return std::nullopt;
}

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::u8: return 1;
    case DType::i64: return 8;
  }
  return 0;
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.rank = static_cast<int>(std::min<std::size_t>(shape.size(), k_max_rank));
  int i = 0;
  for (auto d : shape) if (i < k_max_rank) v.shape[i++] = d;
  std::int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) { v.strides[d] = stride; stride *= v.shape[d]; }
  return v;
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t stride = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

}  // namespace kiln
