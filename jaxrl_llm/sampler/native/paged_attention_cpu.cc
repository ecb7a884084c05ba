// Paged decode attention for XLA:CPU, called through the XLA FFI (jaxrl_llm/sampler/native/__init__.py).
//
// The contract of jaxrl_llm/sampler/paged_attention.py for fp32 pages, reading each slot's keys and
// values straight from the stacked pool [layers, kv_heads, pages, page_size, head_dim] by its page
// table: no gathered blocks are materialised (XLA:CPU's page gathers and q.k reductions read the
// pool at ~2-6 GB/s against the host's ~27 GB/s). Same math as the XLA path and the trainer's
// attention, in fp32: scores = (q . k) * head_dim^-0.5 (soft-capped), softmax as
// exp(s - max) / sum, output = sum(p * v); only the summation order differs (fp32 rounding).
// Work is split over (slot, kv head) pairs on XLA's intra-op thread pool.
//
// A head_dim that is a multiple of 16 takes the vector path: per tile of 16 keys, each query row's
// 16-lane partial products of each key summed into one score per key by a transposing tree
// (`SumEach`), a polynomial exp over whole rows (`Exp`), and probabilities x V with the output rows
// held in registers; keys and values are read page by page (one page-table lookup per page). Other
// head dims take the scalar path (`AttendScalar`), the same math one key at a time.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;

inline float Dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return acc[0] + tail;
}

struct Problem {
  const float* q;        // [slots, heads, head_dim]
  const float* k;        // [layers, kv, pages, page_size, head_dim]
  const float* v;
  const int32_t* lengths;  // [slots]
  const int32_t* table;    // [slots, pages_per_slot]
  float* out;              // [slots, heads, head_dim]
  int64_t layer, kv_heads, num_pages, page_size, head_dim, group, pages_per_slot;
  int64_t window;  // <= 0: none
  float softcap;   // <= 0: none
};

// The page holding key `pos` of a slot's table row, clamped into the pool as XLA clamps a gather's
// indices (the engine's tables are valid for every visible key; this keeps a bad one from reading
// outside the pool).
inline int64_t PageOf(const Problem& p, const int32_t* row, int64_t pos) {
  return std::clamp<int64_t>(row[pos / p.page_size], 0, p.num_pages - 1);
}

// One (slot, kv head): its query rows, output rows, page-table row, the offset of the (layer, head)
// pages in the pool, and its visible keys [lo, lo + n) (the last `window` ones with a sliding window).
struct Slice {
  const float* q;
  float* out;
  const int32_t* row;
  int64_t head_base, lo, n;
};

// The slice of (slot, head); false, with its output zeroed, when the slot has no keys.
inline bool SliceOf(const Problem& p, int64_t slot, int64_t head, Slice& s) {
  const int64_t rows = p.group * p.head_dim;
  s.q = p.q + (slot * p.kv_heads + head) * rows;
  s.out = p.out + (slot * p.kv_heads + head) * rows;
  const int64_t length = std::min<int64_t>(p.lengths[slot], p.pages_per_slot * p.page_size);
  if (length <= 0) {
    std::fill(s.out, s.out + rows, 0.0f);
    return false;
  }
  s.lo = p.window > 0 ? std::max<int64_t>(0, length - p.window) : 0;
  s.n = length - s.lo;
  s.row = p.table + slot * p.pages_per_slot;
  s.head_base = (p.layer * p.kv_heads + head) * p.num_pages * p.page_size * p.head_dim;
  return true;
}

// One (slot, kv head) one key at a time: its `group` query rows against the slot's keys [lo, length).
void AttendScalar(const Problem& p, int64_t slot, int64_t head, std::vector<float>& scores) {
  Slice t;
  if (!SliceOf(p, slot, head, t)) return;
  const int64_t hd = p.head_dim, g = p.group, lo = t.lo, n = t.n, length = lo + n;
  const float* q = t.q;
  float* out = t.out;
  scores.resize(static_cast<size_t>(g * n));
  const int64_t page_stride = p.page_size * hd;
  const float* k_head = p.k + t.head_base;
  const float* v_head = p.v + t.head_base;
  const int32_t* row = t.row;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t pos = lo; pos < length; ++pos) {
    const float* key = k_head + PageOf(p, row, pos) * page_stride + (pos % p.page_size) * hd;
    for (int64_t r = 0; r < g; ++r) {
      float s = Dot(q + r * hd, key, hd) * scale;
      if (p.softcap > 0.0f) s = p.softcap * std::tanh(s / p.softcap);
      scores[r * n + (pos - lo)] = s;
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    float* s = scores.data() + r * n;
    float peak = s[0];
    for (int64_t i = 1; i < n; ++i) peak = std::max(peak, s[i]);
    float total = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - peak);
      total += s[i];
    }
    for (int64_t i = 0; i < n; ++i) s[i] = s[i] / total;
  }
  std::fill(out, out + g * hd, 0.0f);
  for (int64_t pos = lo; pos < length; ++pos) {
    const float* value = v_head + PageOf(p, row, pos) * page_stride + (pos % p.page_size) * hd;
    for (int64_t r = 0; r < g; ++r) {
      const float w = scores[r * n + (pos - lo)];
      float* o = out + r * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] += w * value[d];
    }
  }
}

// ---- vector path (head_dim a multiple of 16): GCC / clang vector extensions, which compile to the
// host's widest registers (one AVX-512 register, two AVX2 ones, ...) under -march=native

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));
constexpr int kRowBlock = 4;  // query rows whose accumulators stay in registers together

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }
inline Vec Splat(float x) { return Vec{} + x; }

// Lane j of the result = the sum of parts[j]'s lanes: a transposing tree of shuffles and adds
// (15 combines for 16 keys, where one horizontal sum per key costs about as much as 4 of them).
inline Vec SumEach(const Vec* parts) {
  Vec t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {  // halves: lanes 0-7 partial sums of key 2i, 8-15 of key 2i+1
    Vec a = parts[2 * i], b = parts[2 * i + 1];
    t[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // quarters: key 4i + quarter
    Vec a = t[2 * i], b = t[2 * i + 1];
    u[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // pairs: key 8i + pair
    Vec a = u[2 * i], b = u[2 * i + 1];
    w[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// exp(x) for x <= 0 (scores minus their maximum): Cephes' expf (range reduction by ln 2, a degree-6
// polynomial), within ~1 ulp of expf; 0 below -87.3 (where expf underflows to denormals).
inline Vec Exp(Vec x) {
  const Vec clamped = x < Splat(-87.3f) ? Splat(-87.3f) : x;
  const Vec magic = Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const Vec n = (clamped * 1.44269504088896341f + magic) - magic;
  const Vec r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  Vec y = Splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const IVec scale = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec two_n;
  std::memcpy(&two_n, &scale, sizeof(two_n));
  return x < Splat(-87.3f) ? Splat(0.0f) : y * two_n;
}

// Reads one slot's key (or value) rows [lo, ...) in order, looking its page table up once per page.
class PageRows {
 public:
  PageRows(const Problem& p, const float* head_base, const int32_t* row, int64_t lo)
      : p_(p), base_(head_base), row_(row), pos_(lo) {}

  const float* Next() {
    if (left_ == 0) {
      const int64_t offset = pos_ % p_.page_size;
      ptr_ = base_ + (PageOf(p_, row_, pos_) * p_.page_size + offset) * p_.head_dim;
      left_ = p_.page_size - offset;
    }
    const float* out = ptr_;
    ptr_ += p_.head_dim;
    --left_;
    ++pos_;
    return out;
  }

 private:
  const Problem& p_;
  const float* base_;
  const int32_t* row_;
  int64_t pos_;
  const float* ptr_ = nullptr;
  int64_t left_ = 0;
};

constexpr int kMaxChunks = 16;  // head_dim <= 256 on the vector path

// Scores of R query rows (q: R x head_dim) against `count` <= 16 keys: out[r * stride + j], lanes past
// `count` 0. D16 = head_dim / 16 (0: `chunks` at run time).
template <int D16, int R>
void ScoreTile(const float* q, int64_t chunks, const float* const* keys, int count, float scale, float* out,
               int64_t stride) {
  const int64_t c16 = D16 > 0 ? D16 : chunks, hd = c16 * kLanes;
  Vec parts[R][kLanes];
  for (int j = 0; j < count; ++j) {
    Vec acc[R] = {};
    for (int64_t c = 0; c < c16; ++c) {
      const Vec k = Load(keys[j] + c * kLanes);
      for (int r = 0; r < R; ++r) acc[r] += Load(q + r * hd + c * kLanes) * k;
    }
    for (int r = 0; r < R; ++r) parts[r][j] = acc[r];
  }
  for (int j = count; j < kLanes; ++j) {
    for (int r = 0; r < R; ++r) parts[r][j] = Vec{};
  }
  for (int r = 0; r < R; ++r) Store(out + r * stride, SumEach(parts[r]) * scale);
}

// out (R x head_dim) = sum over the n keys of weights[r * stride + i] * value row i.
template <int D16, int R>
void AddValues(const float* weights, int64_t stride, PageRows values, int64_t n, int64_t chunks, float* out) {
  const int64_t c16 = D16 > 0 ? D16 : chunks, hd = c16 * kLanes;
  Vec acc[R][D16 > 0 ? D16 : kMaxChunks] = {};
  for (int64_t i = 0; i < n; ++i) {
    const float* v = values.Next();
    for (int64_t c = 0; c < c16; ++c) {
      const Vec value = Load(v + c * kLanes);
      for (int r = 0; r < R; ++r) acc[r][c] += weights[r * stride + i] * value;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < c16; ++c) Store(out + r * hd + c * kLanes, acc[r][c]);
  }
}

// One (slot, kv head) on the vector path (head_dim = 16 * D16, or 16 * `chunks` when D16 is 0).
template <int D16>
void AttendVector(const Problem& p, int64_t slot, int64_t head, std::vector<float>& scores) {
  Slice t;
  if (!SliceOf(p, slot, head, t)) return;
  const int64_t hd = p.head_dim, g = p.group, chunks = hd / kLanes, lo = t.lo, n = t.n, head_base = t.head_base;
  const int64_t stride = (n + kLanes - 1) / kLanes * kLanes;  // score rows padded to whole tiles
  const float* q = t.q;
  float* out = t.out;
  const int32_t* row = t.row;
  scores.resize(static_cast<size_t>(g * stride));
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  PageRows keys(p, p.k + head_base, row, lo);
  const float* tile[kLanes];
  for (int64_t first = 0; first < n; first += kLanes) {
    const int count = static_cast<int>(std::min<int64_t>(kLanes, n - first));
    for (int j = 0; j < count; ++j) tile[j] = keys.Next();
    for (int64_t r0 = 0; r0 < g; r0 += kRowBlock) {
      const float* qr = q + r0 * hd;
      float* s = scores.data() + r0 * stride + first;
      switch (std::min<int64_t>(kRowBlock, g - r0)) {
        case 1: ScoreTile<D16, 1>(qr, chunks, tile, count, scale, s, stride); break;
        case 2: ScoreTile<D16, 2>(qr, chunks, tile, count, scale, s, stride); break;
        case 3: ScoreTile<D16, 3>(qr, chunks, tile, count, scale, s, stride); break;
        default: ScoreTile<D16, 4>(qr, chunks, tile, count, scale, s, stride); break;
      }
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    float* s = scores.data() + r * stride;
    if (p.softcap > 0.0f) {
      for (int64_t i = 0; i < n; ++i) s[i] = p.softcap * std::tanh(s[i] / p.softcap);
    }
    std::fill(s + n, s + stride, -INFINITY);  // the last tile's lanes past the keys: weight 0
    Vec peak = Load(s);
    for (int64_t i = kLanes; i < stride; i += kLanes) {
      const Vec x = Load(s + i);
      peak = x > peak ? x : peak;
    }
    float top = peak[0];
    for (int j = 1; j < kLanes; ++j) top = std::max(top, peak[j]);
    Vec total = {};
    for (int64_t i = 0; i < stride; i += kLanes) {
      const Vec e = Exp(Load(s + i) - top);
      Store(s + i, e);
      total += e;
    }
    float sum = 0.0f;
    for (int j = 0; j < kLanes; ++j) sum += total[j];
    for (int64_t i = 0; i < stride; i += kLanes) Store(s + i, Load(s + i) / sum);
  }
  for (int64_t r0 = 0; r0 < g; r0 += kRowBlock) {
    const float* w = scores.data() + r0 * stride;
    PageRows values(p, p.v + head_base, row, lo);
    float* o = out + r0 * hd;
    switch (std::min<int64_t>(kRowBlock, g - r0)) {
      case 1: AddValues<D16, 1>(w, stride, values, n, chunks, o); break;
      case 2: AddValues<D16, 2>(w, stride, values, n, chunks, o); break;
      case 3: AddValues<D16, 3>(w, stride, values, n, chunks, o); break;
      default: AddValues<D16, 4>(w, stride, values, n, chunks, o); break;
    }
  }
}

void AttendOne(const Problem& p, int64_t slot, int64_t head, std::vector<float>& scores) {
  if (p.head_dim % kLanes != 0 || p.head_dim > kMaxChunks * kLanes) return AttendScalar(p, slot, head, scores);
  switch (p.head_dim / kLanes) {
    case 4: return AttendVector<4>(p, slot, head, scores);
    case 8: return AttendVector<8>(p, slot, head, scores);
    case 16: return AttendVector<16>(p, slot, head, scores);
    default: return AttendVector<0>(p, slot, head, scores);
  }
}

// Tasks pulled from a shared counter by the calling thread and the pool's helpers; the caller
// returns once every claimed task is done (a helper that starts late finds none left).
struct Work {
  Problem problem;
  int64_t tasks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void Run() {
    thread_local std::vector<float> scores;
    int64_t finished = 0;
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      AttendOne(problem, t / problem.kv_heads, t % problem.kv_heads, scores);
      ++finished;
    }
    if (finished > 0 && done.fetch_add(finished) + finished == tasks) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};

ffi::Error PagedAttentionCpu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                             ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths,
                             ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> out, int64_t window, float softcap) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || v.dimensions().size() != 5) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: expected q [S,H,D], pages [L,KV,P,PS,D], table [S,PP]");
  }
  const int64_t slots = qd[0], heads = qd[1], hd = qd[2];
  const int64_t kv = kd[1];
  if (kd[4] != hd || heads % kv != 0 || td[0] != slots) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: q / pages / table shapes disagree");
  }
  const int64_t layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= kd[0]) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: layer index out of range");
  }
  auto work = std::make_shared<Work>();
  work->problem = Problem{q.typed_data(), k.typed_data(), v.typed_data(), lengths.typed_data(),
                          table.typed_data(), out->typed_data(), layer_index, kv, kd[2], kd[3], hd,
                          heads / kv, td[1], window, softcap};
  work->tasks = slots * kv;
  // helpers only where there is enough work to pay for the hand-off (~a few microseconds each)
  int64_t keys = 0;
  for (int64_t s = 0; s < slots; ++s) keys += std::max<int32_t>(0, lengths.typed_data()[s]);
  const int64_t by_work = keys * kv * hd / (1 << 16);
  const int64_t helpers = std::min<int64_t>({pool.num_threads(), work->tasks - 1, by_work});
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done.load() == work->tasks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlPagedAttentionCpu, PagedAttentionCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap"));
