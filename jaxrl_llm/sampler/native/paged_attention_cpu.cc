// Paged decode attention for XLA:CPU, called through the XLA FFI (jaxrl_llm/sampler/native/__init__.py).
//
// The contract of jaxrl_llm/sampler/paged_attention.py for fp32 pages, reading each slot's keys and
// values straight from the stacked pool [layers, kv_heads, pages, page_size, head_dim] by its page
// table: no gathered blocks are materialised (XLA:CPU's page gathers and q.k reductions read the
// pool at ~2-6 GB/s against the host's ~27 GB/s). Same math as the XLA path and the trainer's
// attention, in fp32: scores = (q . k) * head_dim^-0.5 (soft-capped), softmax as
// exp(s - max) / sum, output = sum(p * v); only the summation order differs (fp32 rounding).
// Work is split over (slot, kv head) pairs on XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
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

// One (slot, kv head): its `group` query rows against the slot's keys [lo, length).
void AttendOne(const Problem& p, int64_t slot, int64_t head, std::vector<float>& scores) {
  const int64_t hd = p.head_dim, g = p.group;
  const float* q = p.q + (slot * p.kv_heads + head) * g * hd;
  float* out = p.out + (slot * p.kv_heads + head) * g * hd;
  const int64_t length = std::min<int64_t>(p.lengths[slot], p.pages_per_slot * p.page_size);
  if (length <= 0) {
    std::fill(out, out + g * hd, 0.0f);
    return;
  }
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, length - p.window) : 0;
  const int64_t n = length - lo;
  scores.resize(static_cast<size_t>(g * n));
  const int64_t page_stride = p.page_size * hd;
  const int64_t head_base = (p.layer * p.kv_heads + head) * p.num_pages * page_stride;
  const float* k_head = p.k + head_base;
  const float* v_head = p.v + head_base;
  const int32_t* row = p.table + slot * p.pages_per_slot;
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
