// Causal grouped-query attention that reads the paged K||V cache in place (docs/cpu_kernels.md,
// "Paged attention"). The contract is layers/attention/paged_attention.py's (the reference op):
//
//   q            [T, H, D]   rotated queries, fp32 or bf16; the step's tokens, request-major;
//                any token and head strides (a view into the qkv GEMM output is read in place)
//   cache        [blocks, block_size, 2*Hkv*D]  entry = [k_0 .. k_{Hkv-1} | v_0 .. v_{Hkv-1}]
//   block_table  [rows, max_blocks] int64; request r's row is req_rows[r] (identity if absent)
//   query_start_loc [R+1], seq_lens [R] int64: request r's queries are rows qsl[r]..qsl[r+1]-1
//                at positions seq_len - query_len .. seq_len-1 (their entries already written)
//   window       <= 0: full attention; else query position p sees keys (p - window, p]
//
// paged_attention_write is the same op that first stores the step's new entries: token t's
// [k_t | v_t] (k/v [T, Hkv, D]) goes to flat slot slot_mapping[t] (skipped where < 0), all of
// them before any query is attended, as the reference's write-then-attend does.
//
// Two implementations of the same loop (paged_attention.h): a portable one here (plain C++)
// and an AVX512 one (paged_attention_avx512.cpp). `portable=true` forces the first, so both
// are testable on one machine.
#include "paged_attention.h"

#include <cstring>
#include <type_traits>

#include <ATen/Parallel.h>
#include <torch/library.h>

namespace wideserve_paged {
namespace {

// x[j] <- exp(x[j] - max), max = max(*mx, x[0..n)) written back to *mx; returns the sum.
float exp_span_portable(float* x, int64_t n, float* mx_io) {
  float mx = *mx_io;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, x[j]);
  *mx_io = mx;
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - mx);
    sum += x[j];
  }
  return sum;
}

template <typename QT, typename CT>
void attend_portable(const Problem& p, const Item& it, const Item* /*next*/, Scratch& w) {
  Span s = span_of(p, it);
  const int64_t D = p.dim, voff = p.kv_heads * D;
  const CT** kp = start_item<QT, CT>(p, it, s, w);
  for (int64_t k0 = s.lo; k0 < s.hi; k0 += kTile) {
    int64_t k1 = std::min(k0 + kTile, s.hi), n = k1 - k0;
    entry_ptrs<CT>(p, it, k0, k1, kp);
    for (int64_t r = 0; r < s.rows; ++r) {
      int64_t a, b;
      row_range(p, it, s, r, k0, k1, &a, &b);
      float* srow = w.s.data() + r * kTile;
      const float* qr = w.q.data() + r * D;
      const int64_t koff = (r / s.head_rows) * D;
      for (int64_t j = a - k0; j < b - k0; ++j) {
        const CT* kr = kp[j] + koff;
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * to_f32(kr[d]);
        srow[j] = dot * p.scale;
      }
      softmax_update(srow, n, a - k0, b - k0, &w.m[r], &w.l[r], w.acc.data() + r * D, D,
                     exp_span_portable);
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t r = 0; r < s.rows; ++r) {
        const CT* vr = kp[j] + voff + (r / s.head_rows) * D;
        float pj = w.s[r * kTile + j];
        if (pj == 0.0f) continue;
        float* ar = w.acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) ar[d] += pj * to_f32(vr[d]);
      }
    }
  }
  store_outputs<QT>(p, it, s, w.acc.data(), w.l.data());
}

// ---------------------------------------------------------------- the op

// Queries per work item: kMaxRows folded rows per KV head.
inline int64_t query_block(const Problem& p) { return std::max<int64_t>(1, kMaxRows / p.groups); }

// Work items: (request, block of queries); requests with no queries this step have none.
std::vector<Item> make_items(const Problem& p, int64_t num_reqs) {
  std::vector<Item> items;
  const int64_t qblock = query_block(p);
  for (int64_t r = 0; r < num_reqs; ++r) {
    int64_t qlen = p.qsl[r + 1] - p.qsl[r];
    TORCH_CHECK(qlen >= 0 && qlen <= p.seq_lens[r], "paged_attention: request ", r, " has ",
                qlen, " queries but seq_len ", p.seq_lens[r]);
    for (int64_t q0 = 0; q0 < qlen; q0 += qblock)
      items.push_back(Item{r, q0, std::min(qlen, q0 + qblock)});
  }
  return items;
}

// Item boundaries of `parts` consecutive runs of about equal work (keys read x rows, plus a
// fixed cost per item). Equal item counts per thread, what at::parallel_for gives, leave one
// thread idle while the other finishes longer contexts.
std::vector<int64_t> balanced_runs(const Problem& p, const std::vector<Item>& items,
                                   int64_t parts) {
  std::vector<double> done(items.size() + 1, 0.0);
  for (size_t i = 0; i < items.size(); ++i) {
    Span s = span_of(p, items[i]);
    done[i + 1] = done[i] + static_cast<double>(s.hi - s.lo) * (s.rows + 4) + 256.0;
  }
  std::vector<int64_t> bounds(parts + 1, static_cast<int64_t>(items.size()));
  bounds[0] = 0;
  for (int64_t c = 1; c < parts; ++c) {
    double target = done.back() * static_cast<double>(c) / static_cast<double>(parts);
    bounds[c] = std::lower_bound(done.begin(), done.end(), target) - done.begin();
    bounds[c] = std::max(bounds[c - 1], bounds[c]);
  }
  return bounds;
}

void run(const Problem& p, const std::vector<Item>& items, bool q_bf16, bool cache_bf16,
         bool portable) {
  AttendFn fn = q_bf16 ? (cache_bf16 ? attend_portable<at::BFloat16, at::BFloat16>
                                     : attend_portable<at::BFloat16, float>)
                       : (cache_bf16 ? attend_portable<float, at::BFloat16>
                                     : attend_portable<float, float>);
  if (AttendFn fast = avx512_attend(q_bf16, cache_bf16); fast && !portable && p.dim % 16 == 0)
    fn = fast;
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> bounds = balanced_runs(p, items, parts);
  at::parallel_for(0, parts, 1, [&](int64_t c0, int64_t c1) {
    Scratch w(query_block(p) * p.heads, p.dim);
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t i = bounds[c], e = bounds[c + 1]; i < e; ++i)
        fn(p, items[i], i + 1 < e ? &items[i + 1] : nullptr, w);
  });
}

// Store token t's [k_t | v_t] (each [Hkv, D], any token/head strides, unit column stride) at
// flat slot slots[t] of the cache, in the cache's dtype (round to nearest even, as .to()).
template <typename ST, typename CT>
void write_entries(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                   at::Tensor& cache) {
  const int64_t T = k.size(0), kvh = k.size(1), D = k.size(2), width = cache.size(2);
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] < num_slots, "paged_kv_write: slot_mapping[", t, "] = ", sl[t],
                " is past the cache's ", num_slots, " slots");
  const ST* kp = k.data_ptr<ST>();
  const ST* vp = v.data_ptr<ST>();
  CT* dst = cache.data_ptr<CT>();
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (sl[t] < 0) continue;
      CT* e = dst + sl[t] * width;
      for (int64_t h = 0; h < kvh; ++h) {
        const ST* ks = kp + t * k.stride(0) + h * k.stride(1);
        const ST* vs = vp + t * v.stride(0) + h * v.stride(1);
        if constexpr (std::is_same_v<ST, CT>) {   // a copy (an element-wise cast was 3x slower)
          std::memcpy(e + h * D, ks, D * sizeof(CT));
          std::memcpy(e + (kvh + h) * D, vs, D * sizeof(CT));
        } else {
          for (int64_t d = 0; d < D; ++d) e[h * D + d] = static_cast<CT>(ks[d]);
          for (int64_t d = 0; d < D; ++d) e[(kvh + h) * D + d] = static_cast<CT>(vs[d]);
        }
      }
    }
  });
}

void check_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "paged_attention: ", name, " must be float32 or bfloat16");
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& cache,
                           const at::Tensor& block_table,
                           const std::optional<at::Tensor>& req_rows_in,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           double scale, int64_t window, bool portable) {
  TORCH_CHECK(q_in.dim() == 3, "paged_attention: q must be [T, H, D]");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous(),
              "paged_attention: cache must be a contiguous [blocks, block_size, width]");
  check_dtype(q_in, "q");
  check_dtype(cache, "cache");
  for (const at::Tensor* t : {&block_table, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu(),
                "paged_attention: index tensors must be int64 CPU tensors");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1,
              "paged_attention: block_table must be [rows, max_blocks] with unit row stride");
  at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  at::Tensor qsl = query_start_loc.contiguous(), lens = seq_lens.contiguous();
  const int64_t num_reqs = lens.numel();
  TORCH_CHECK(qsl.numel() == num_reqs + 1, "paged_attention: query_start_loc must be [R+1]");
  const int64_t heads = q.size(1), dim = q.size(2), width = cache.size(2);
  TORCH_CHECK(dim > 0 && width % (2 * dim) == 0, "paged_attention: cache width ", width,
              " is not 2 * kv_heads * head_dim (head_dim ", dim, ")");
  const int64_t kv_heads = width / (2 * dim);
  TORCH_CHECK(heads % kv_heads == 0, "paged_attention: ", heads,
              " query heads are not a multiple of ", kv_heads, " KV heads");
  TORCH_CHECK(qsl.data_ptr<int64_t>()[num_reqs] == q.size(0),
              "paged_attention: query_start_loc does not end at T");
  at::Tensor req_rows;
  if (req_rows_in.has_value()) {
    req_rows = req_rows_in->contiguous();
    TORCH_CHECK(req_rows.scalar_type() == at::kLong && req_rows.numel() == num_reqs,
                "paged_attention: req_rows must be int64 [R]");
    const int64_t* rr = req_rows.data_ptr<int64_t>();
    for (int64_t r = 0; r < num_reqs; ++r)
      TORCH_CHECK(rr[r] >= 0 && rr[r] < block_table.size(0), "paged_attention: req_rows[", r,
                  "] out of range");
  } else {
    TORCH_CHECK(block_table.size(0) >= num_reqs, "paged_attention: block_table has fewer rows "
                "than requests");
  }
  const int64_t block_size = cache.size(1);
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_reqs; ++r)
    TORCH_CHECK(lp[r] >= 0 && (lp[r] + block_size - 1) / block_size <= block_table.size(1),
                "paged_attention: seq_lens[", r, "] = ", lp[r], " passes its block table");

  at::Tensor out = at::empty(q.sizes(), q.options());
  Problem p{static_cast<const char*>(q.data_ptr()), q.stride(0), q.stride(1),
            static_cast<char*>(out.data_ptr()), static_cast<const char*>(cache.data_ptr()),
            block_table.data_ptr<int64_t>(), block_table.stride(0),
            req_rows.defined() ? req_rows.data_ptr<int64_t>() : nullptr,
            qsl.data_ptr<int64_t>(), lp, heads, kv_heads, heads / kv_heads, dim, width,
            block_size, cache.size(0), window, static_cast<float>(scale)};
  run(p, make_items(p, num_reqs), q.scalar_type() == at::kBFloat16,
      cache.scalar_type() == at::kBFloat16, portable);
  return out;
}

// Every token's [k_t | v_t] at its slot: the write half of paged_attention_write (its errors
// say paged_kv_write), and an op of its own for the steps whose attention goes elsewhere (SDPA,
// the flash kernel).
void paged_kv_write(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& cache,
                    const at::Tensor& slot_mapping);

at::Tensor paged_attention_write(const at::Tensor& q, const at::Tensor& k_in,
                                 const at::Tensor& v_in, at::Tensor& cache,
                                 const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                 const std::optional<at::Tensor>& req_rows,
                                 const at::Tensor& query_start_loc,
                                 const at::Tensor& seq_lens, double scale, int64_t window,
                                 bool portable) {
  TORCH_CHECK(k_in.dim() == 3 && q.dim() == 3 && k_in.size(0) == q.size(0) &&
                  k_in.size(2) == q.size(2),
              "paged_attention_write: k/v [T, Hkv, D] do not match q [T, H, D]");
  paged_kv_write(k_in, v_in, cache, slot_mapping);
  return paged_attention(q, cache, block_table, req_rows, query_start_loc, seq_lens, scale,
                         window, portable);
}

void paged_kv_write(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_in.dim() == 3 && v_in.sizes() == k_in.sizes() &&
                  k_in.scalar_type() == v_in.scalar_type(),
              "paged_kv_write: k and v must be [T, Hkv, D] of one dtype");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && 2 * k_in.size(1) * k_in.size(2) ==
                  cache.size(2),
              "paged_kv_write: cache width is not 2 * Hkv * D");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.device().is_cpu() &&
                  slot_mapping.numel() == k_in.size(0),
              "paged_kv_write: slot_mapping must be int64 CPU [T]");
  check_dtype(k_in, "k");
  check_dtype(cache, "cache");
  at::Tensor k = k_in.stride(2) == 1 ? k_in : k_in.contiguous();
  at::Tensor v = v_in.stride(2) == 1 ? v_in : v_in.contiguous();
  at::Tensor slots = slot_mapping.contiguous();
  const bool kb = k.scalar_type() == at::kBFloat16, cb = cache.scalar_type() == at::kBFloat16;
  if (kb && cb) write_entries<at::BFloat16, at::BFloat16>(k, v, slots, cache);
  else if (kb) write_entries<at::BFloat16, float>(k, v, slots, cache);
  else if (cb) write_entries<float, at::BFloat16>(k, v, slots, cache);
  else write_entries<float, float>(k, v, slots, cache);
}

}  // namespace
}  // namespace wideserve_paged

TORCH_LIBRARY_FRAGMENT(wideserve, m) {
  m.def("paged_attention(Tensor q, Tensor cache, Tensor block_table, Tensor? req_rows, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int window, "
        "bool portable=False) -> Tensor");
  m.def("paged_attention_write(Tensor q, Tensor k, Tensor v, Tensor(a!) cache, "
        "Tensor slot_mapping, Tensor block_table, Tensor? req_rows, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int window, bool portable=False) -> Tensor");
  m.def("paged_kv_write(Tensor k, Tensor v, Tensor(a!) cache, Tensor slot_mapping) -> ()");
  // Whether this build has the AVX512 path (else `portable` changes nothing).
  m.def("paged_attention_has_avx512() -> bool",
        [] { return wideserve_paged::avx512_attend(false, false) != nullptr; });
}

TORCH_LIBRARY_IMPL(wideserve, CPU, m) {
  m.impl("paged_attention", &wideserve_paged::paged_attention);
  m.impl("paged_attention_write", &wideserve_paged::paged_attention_write);
  m.impl("paged_kv_write", &wideserve_paged::paged_kv_write);
}
