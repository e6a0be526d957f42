// Skip-observation GAE in one pass over memory on a CPU: XLA FFI handlers for the forward map
// and its transpose (kernels/gae_cpu.py compiles this file on first use and registers them).
//
// Per row, with g = gamma * lam, u = gamma * (1 - lam) and H past the last token = h_end
// (gamma times the bootstrap value), from the right (docs/algorithm.md §2, the recurrence on H):
//
//     e_t = m_t ? u * v_t + g * r_t : r_t,     c_t = m_t ? g : 1
//     H_t = e_t + c_t * H_{t+1},               G_t = r_t + H_{t+1}
//     A_t = m_t ? G_t - v_t : 0,               R_t = m_t ? G_t : 0
//
// The transpose runs from the left, lambda_t the cotangent of H_{t+1}:
//
//     lambda_t = (m_t ? a_t + q_t : 0) + c_t * lambda_{t-1},   lambda_{-1} = 0
//     dr_t = lambda_t,   dv_t = m_t ? u * lambda_{t-1} - a_t : 0,   dh_end = lambda_{T-1}
//
// for cotangents a (of A) and q (of R). Each row is cut into blocks of W tokens, one vector
// register each: an affine map x -> e + c x per token, composed inside the block by a log-step
// scan across lanes, then applied to the carry from the neighbouring block, so the only serial
// dependence is one multiply-add a block. Every coefficient is a power of the row's g: the scan
// composes exact integer counts k of action tokens and reads g^k from a table of 0..W (each
// entry one rounding), so the rounding of a product of g's never repeats block after block
// (the Pallas kernel's rule, kernels/gae.py). Rows are split over threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int W = 16;  // tokens a block: one 512-bit register (two 256-bit ones without AVX-512)
typedef float vec __attribute__((vector_size(W * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint8_t bvec __attribute__((vector_size(W)));

template <int S, int... I>
constexpr ivec DownMask(std::integer_sequence<int, I...>) {  // lane j takes lane j + S
  return ivec{(I + S < W ? I + S : W + I)...};
}
template <int S, int... I>
constexpr ivec UpMask(std::integer_sequence<int, I...>) {  // lane j takes lane j - S
  return ivec{(I >= S ? I - S : W + I)...};
}
template <int S>
inline vec Down(vec a, vec fill) {
  constexpr ivec mask = DownMask<S>(std::make_integer_sequence<int, W>());
  return __builtin_shuffle(a, fill, mask);
}
template <int S>
inline vec Up(vec a, vec fill) {
  constexpr ivec mask = UpMask<S>(std::make_integer_sequence<int, W>());
  return __builtin_shuffle(a, fill, mask);
}

inline vec Load(const float* p) {
  vec x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline void Store(float* p, vec x) { std::memcpy(p, &x, sizeof(x)); }
inline ivec LoadMask(const bool* p) {
  bvec b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, ivec) != 0;
}
inline vec Splat(float x) { return vec{} + x; }

// g^k for k = 0..W, each rounded once from double, in two registers (lanes 0..W-1, then W).
struct Powers {
  vec lo, hi;
  explicit Powers(float g) {
    for (int k = 0; k < W; ++k) lo[k] = static_cast<float>(std::pow(double{g}, k));
    hi = Splat(static_cast<float>(std::pow(double{g}, W)));
  }
  vec operator()(vec k) const {  // g^k per lane, k an exact integer in [0, W]
    return __builtin_shuffle(lo, hi, __builtin_convertvector(k, ivec));
  }
};

// The composition of each lane's map with those after it (Suffix) or before it (Prefix) inside
// the block: e and the count k in, the composed e and k out.
template <bool kSuffix, int S>
inline void ScanStep(vec& e, vec& k, const Powers& pow_g) {
  const vec zero{};
  const vec e_next = kSuffix ? Down<S>(e, zero) : Up<S>(e, zero);
  const vec k_next = kSuffix ? Down<S>(k, zero) : Up<S>(k, zero);
  e = e + pow_g(k) * e_next;
  k = k + k_next;
}
template <bool kSuffix>
inline void Scan(vec& e, vec& k, const Powers& pow_g) {
  ScanStep<kSuffix, 1>(e, k, pow_g);
  ScanStep<kSuffix, 2>(e, k, pow_g);
  ScanStep<kSuffix, 4>(e, k, pow_g);
  ScanStep<kSuffix, 8>(e, k, pow_g);
}

void ForwardRow(const float* r, const float* v, const bool* m, float g, float u, float h_end,
                int64_t n, float* adv, float* ret) {
  const Powers pow_g(g);
  const vec one = Splat(1.0f), zero{};
  float h = h_end;  // H just past the block
  int64_t t = n;
  for (; t >= W; t -= W) {
    const int64_t s = t - W;
    const vec rt = Load(r + s), vt = Load(v + s);
    const ivec mt = LoadMask(m + s);
    vec e = mt ? u * vt + g * rt : rt;
    vec k = mt ? one : zero;
    Scan<true>(e, k, pow_g);
    const vec h_in = Splat(h);
    const vec ht = e + pow_g(k) * h_in;  // H_t
    const vec gt = rt + Down<1>(ht, h_in);  // r_t + H_{t+1}
    Store(adv + s, mt ? gt - vt : zero);
    Store(ret + s, mt ? gt : zero);
    h = ht[0];
  }
  for (int64_t i = t - 1; i >= 0; --i) {  // the first n % W tokens
    const float gi = r[i] + h;
    adv[i] = m[i] ? gi - v[i] : 0.0f;
    ret[i] = m[i] ? gi : 0.0f;
    h = m[i] ? u * v[i] + g * r[i] + g * h : r[i] + h;
  }
}

void BackwardRow(const float* a, const float* q, const bool* m, float g, float u, int64_t n,
                 float* dr, float* dv, float* dh_end) {
  const Powers pow_g(g);
  const vec one = Splat(1.0f), zero{};
  float lam = 0.0f;  // lambda of the token before the block
  int64_t t = 0;
  for (; t + W <= n; t += W) {
    const vec at = Load(a + t), qt = Load(q + t);
    const ivec mt = LoadMask(m + t);
    vec e = mt ? at + qt : zero;
    vec k = mt ? one : zero;
    Scan<false>(e, k, pow_g);
    const vec lam_in = Splat(lam);
    const vec lt = e + pow_g(k) * lam_in;  // lambda_t
    Store(dr + t, lt);
    Store(dv + t, mt ? u * Up<1>(lt, lam_in) - at : zero);
    lam = lt[W - 1];
  }
  for (; t < n; ++t) {  // the last n % W tokens
    dv[t] = m[t] ? u * lam - a[t] : 0.0f;
    lam = (m[t] ? a[t] + q[t] : 0.0f) + (m[t] ? g : 1.0f) * lam;
    dr[t] = lam;
  }
  *dh_end = lam;
}

// Runs fn(row) for every row, the rows split over up to hardware_concurrency threads once the
// work is large enough to pay for starting them.
template <typename Fn>
void ForRows(int64_t rows, int64_t length, Fn fn) {
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t threads = std::min<int64_t>({cores, rows, std::max<int64_t>(1, rows * length >> 16)});
  if (threads <= 1) {
    for (int64_t b = 0; b < rows; ++b) fn(b);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < threads; ++i) {
    pool.emplace_back([=] {
      for (int64_t b = rows * i / threads; b < rows * (i + 1) / threads; ++b) fn(b);
    });
  }
  for (int64_t b = 0; b < rows / threads; ++b) fn(b);
  for (auto& thread : pool) thread.join();
}

// Rows are every leading dimension (vmap adds one), tokens the last.
std::pair<int64_t, int64_t> RowsAndLength(ffi::AnyBuffer::Dimensions dims) {
  if (dims.size() == 0) return {1, 1};
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  return {rows, dims.back()};
}

ffi::Error Forward(ffi::Buffer<ffi::F32> r, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> m,
                   ffi::Buffer<ffi::F32> h_end, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                   ffi::ResultBuffer<ffi::F32> adv, ffi::ResultBuffer<ffi::F32> ret) {
  const auto [rows, n] = RowsAndLength(r.dimensions());
  if (v.element_count() != rows * n || m.element_count() != rows * n ||
      h_end.element_count() != rows || g.element_count() != rows || u.element_count() != rows) {
    return ffi::Error::InvalidArgument("sao_jax_gae_forward: operands of mismatched shapes");
  }
  ForRows(rows, n, [&](int64_t b) {
    ForwardRow(r.typed_data() + b * n, v.typed_data() + b * n, m.typed_data() + b * n,
               g.typed_data()[b], u.typed_data()[b], h_end.typed_data()[b], n,
               adv->typed_data() + b * n, ret->typed_data() + b * n);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::PRED> m,
                    ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                    ffi::ResultBuffer<ffi::F32> dr, ffi::ResultBuffer<ffi::F32> dv,
                    ffi::ResultBuffer<ffi::F32> dh_end) {
  const auto [rows, n] = RowsAndLength(a.dimensions());
  if (q.element_count() != rows * n || m.element_count() != rows * n ||
      g.element_count() != rows || u.element_count() != rows) {
    return ffi::Error::InvalidArgument("sao_jax_gae_backward: operands of mismatched shapes");
  }
  ForRows(rows, n, [&](int64_t b) {
    BackwardRow(a.typed_data() + b * n, q.typed_data() + b * n, m.typed_data() + b * n,
                g.typed_data()[b], u.typed_data()[b], n, dr->typed_data() + b * n,
                dv->typed_data() + b * n, dh_end->typed_data() + b);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SaoJaxGaeForward, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SaoJaxGaeBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
