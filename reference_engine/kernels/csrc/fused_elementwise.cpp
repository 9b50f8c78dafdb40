// Fused elementwise layers on the CPU: RMSNorm, SwiGLU's silu(gate) * up and RoPE, each one pass over its
// rows instead of the five to eight tensors the torch path writes and reads again (in bfloat16 every one
// of them also widened to float32 and rounded back). The readable oracle is the torch path in
// reference_engine/model.py (RMSNorm.forward, MLP.forward); reference_engine/cpu_elementwise.py has the
// measurements and the contract, and tests/engine/test_cpu_elementwise.py holds these kernels to the torch path.
//
// The rounding follows the torch path step by step, so bfloat16 results are those of the torch path but
// for the sum of squares (summed in another order: within float32 rounding of it):
//   RMSNorm   n = bf16(x * (1 / sqrt(mean(x * x) + eps)))      out = bf16(w * n)        (float32 math)
//   SwiGLU    s = bf16(g / (1 + exp(-g)))                       out = bf16(s * u)
//   RoPE      a = bf16(x * cos)   b = bf16(rotate_half(x) * sin)  out = bf16(a + b)
// exp is Sleef's expf (1 ulp), the one torch's own vectorised silu calls, on 16 lanes with AVX-512 and on 8
// with AVX2 (each split into vectorised part and scalar tail as torch's kernel of that CPU splits it);
// the scalar tail uses std::exp, as torch's kernel does for its tail (bit-equal where torch's own CPU
// kernels are the build of the same instruction set: AVX-512 or AVX2; elsewhere within 1 ulp of the exp). No -ffast-math here: the compiler
// must not contract or reorder what the torch path rounds separately.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);  // exported by libtorch_cpu (torch's vectorised exp)
#elif defined(__AVX2__)
#include <immintrin.h>
extern "C" __m256 Sleef_expf8_u10(__m256);  // the 8-lane one, which torch's AVX2 build calls
#endif

namespace {

inline float widen(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float32 -> bfloat16, round to nearest even (c10::BFloat16's rounding); a NaN stays a quiet NaN
inline uint16_t narrow(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) { return widen(p[i]); }
template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = narrow(v); }
// the value a float32 result has once the torch path stores it in T
template <typename T> inline float rounded(float v);
template <> inline float rounded<float>(float v) { return v; }
template <> inline float rounded<uint16_t>(float v) { return widen(narrow(v)); }

#if defined(__AVX512F__)
// 16 lanes at a time, with the same conversions and rounding as widen() / narrow() above
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// the bfloat16 bits of each lane (in the low half of a 32-bit lane), rounded to nearest even
inline __m512i narrow_bits(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_srli_epi32(r, 16);
}
inline __m512 rounded16(__m512 v, const float*) { return v; }
inline __m512 rounded16(__m512 v, const uint16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(narrow_bits(v), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(narrow_bits(v)));
}
#elif defined(__AVX2__)
// 8 lanes at a time (a CPU without AVX-512), the same conversions and rounding again
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256i narrow_bits8(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
  return _mm256_srli_epi32(r, 16);
}
inline __m256 rounded8(__m256 v, const float*) { return v; }
inline __m256 rounded8(__m256 v, const uint16_t*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(narrow_bits8(v), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  __m256i bits = narrow_bits8(v);  // each lane <= 0xFFFF, so the saturating pack keeps it
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
#endif

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * hidden;
      // 16 running sums (one per lane of a vector): each lane's order is fixed, so the compiler can
      // vectorise the loop without reassociating anything
      float acc[16] = {0};
      int64_t i = 0;
      for (; i + 16 <= hidden; i += 16)
        for (int j = 0; j < 16; ++j) {
          float v = load(xr, i + j);
          acc[j] += v * v;
        }
      float sum = 0.f;
      for (int j = 0; j < 16; ++j) sum += acc[j];
      for (; i < hidden; ++i) {
        float v = load(xr, i);
        sum += v * v;
      }
      float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      for (int64_t k = 0; k < hidden; ++k) store(o, k, load(w, k) * rounded<T>(load(xr, k) * inv));
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.0f);
      // 32 elements at a time and the rest one by one, as torch's own (AVX-512) kernel splits a row: two
      // float32 vectors, or one of 32 bfloat16; so each element meets the exp it meets on the torch path
      for (; i + 32 <= inter; i += 32)
        for (int64_t h = i; h < i + 32; h += 16) {
          __m512 x = load16(g + h);
          __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x));
          __m512 s = rounded16(_mm512_div_ps(x, _mm512_add_ps(one, e)), o);
          store16(o + h, _mm512_mul_ps(s, load16(u + h)));
        }
#elif defined(__AVX2__)
      const __m256 one = _mm256_set1_ps(1.0f);
      // torch's AVX2 kernel takes two of its vectors at a time: 16 float32 or 32 bfloat16 elements (a
      // bfloat16 vector holds 16), then the rest one by one; the same split, for the same exp per element
      constexpr int64_t chunk = sizeof(T) == 4 ? 16 : 32;
      for (; i + chunk <= inter; i += chunk)
        for (int64_t h = i; h < i + chunk; h += 8) {
          __m256 x = load8(g + h);
          __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), x));
          __m256 s = rounded8(_mm256_div_ps(x, _mm256_add_ps(one, e)), o);
          store8(o + h, _mm256_mul_ps(s, load8(u + h)));
        }
#endif
      for (; i < inter; ++i) {
        float x = load(g, i);
        store(o, i, rounded<T>(x / (1.0f + std::exp(-x))) * load(u, i));
      }
    }
  });
}

// RoPE, rotate-half layout, one pass: for j < D/2, out[j] = x[j] c[j] - x[j + D/2] s[j]; for j >= D/2,
// out[j] = x[j] c[j] + x[j - D/2] s[j]; each product and the sum rounded to T as the torch path rounds them
// (-(a b) is (-a) b exactly, so the negated half needs no rounding of its own)
template <typename T>
void rope_rows(const T* x, int64_t row_stride, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads,
               int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * dim;
      const T* sn = sin + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + r * row_stride + h * dim;
        T* o = out + (r * heads + h) * dim;
        for (int64_t j = 0; j < half; ++j) {
          float a = rounded<T>(load(xr, j) * load(c, j));
          float b = rounded<T>(-load(xr, j + half) * load(sn, j));
          store(o, j, a + b);
        }
        for (int64_t j = half; j < dim; ++j) {
          float a = rounded<T>(load(xr, j) * load(c, j));
          float b = rounded<T>(load(xr, j - half) * load(sn, j));
          store(o, j, a + b);
        }
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1,
              what, ": expected a 2-D CPU tensor with contiguous rows");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16,
              what, ": expected float32 or bfloat16, got ", t.scalar_type());
}

}  // namespace

// x: [T, H] with contiguous rows; weight: [H] in x's dtype. Returns a new contiguous [T, H].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type()
              && weight.is_contiguous(), "rms_norm weight: expected a contiguous [H] in x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat32)
    rms_norm_rows<float>(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), out.data_ptr<float>(),
                         x.size(0), x.size(1), static_cast<float>(eps));
  else
    rms_norm_rows<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                            reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                            reinterpret_cast<uint16_t*>(out.data_ptr()), x.size(0), x.size(1),
                            static_cast<float>(eps));
  return out;
}

// gate_up: [T, 2 I] with contiguous rows, gate then up. Returns a new contiguous [T, I]: silu(gate) * up.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_mul gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul gate_up: expected an even number of columns");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32)
    silu_mul_rows<float>(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), gate_up.size(0),
                         inter);
  else
    silu_mul_rows<uint16_t>(reinterpret_cast<const uint16_t*>(gate_up.data_ptr()), gate_up.stride(0),
                            reinterpret_cast<uint16_t*>(out.data_ptr()), gate_up.size(0), inter);
  return out;
}

// x: [T, H, D], heads contiguous within a row (a row may be a slice of a wider product); cos, sin: [T, 1, D]
// contiguous, in x's dtype. Returns a new contiguous [T, H, D]: x * cos + rotate_half(x) * sin.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2)
              && x.size(2) % 2 == 0, "rope x: expected a CPU [T, H, D] with D even and each row's heads contiguous");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "rope x: expected float32 or bfloat16, got ", x.scalar_type());
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == x.size(0) && t->size(1) == 1 && t->size(2) == x.size(2)
                && t->is_contiguous() && t->scalar_type() == x.scalar_type(),
                "rope cos/sin: expected a contiguous [T, 1, D] in x's dtype");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == torch::kFloat32)
    rope_rows<float>(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                     out.data_ptr<float>(), x.size(0), x.size(1), x.size(2));
  else
    rope_rows<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                        reinterpret_cast<const uint16_t*>(cos.data_ptr()),
                        reinterpret_cast<const uint16_t*>(sin.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                        x.size(0), x.size(1), x.size(2));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope", &rope, "RoPE, rotate-half layout, over rows (reference_engine/csrc/fused_elementwise.cpp)");
  m.def("rms_norm", &rms_norm, "RMSNorm over rows (reference_engine/csrc/fused_elementwise.cpp)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up over rows (reference_engine/csrc/fused_elementwise.cpp)");
}
