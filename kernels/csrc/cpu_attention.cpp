// Paged decode attention for the CPU engine: one query token per sequence, read straight from
// the block-major paged KV cache.
//
// The PyTorch path it replaces copied every sequence's blocks into a padded contiguous tensor in
// every layer of every step, then ran two batched matmuls; at a few hundred tokens of context
// the copies cost more than the arithmetic, and bf16 batched matmuls have no fast path on CPUs
// without AVX512-BF16. Here each (sequence, KV head) walks its block table once, reading K and V
// where they lie, with an online softmax (flash-decoding's running max and sum) so nothing of
// context length is stored.
//
//   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], views of
//                     kv_cache[:, layer, 0|1] (stride(0) jumps over every layer of a block)
//   q, out:           [num_seqs, num_heads, head_dim], contiguous
//   block_tables:     [num_seqs, max_blocks] int32 or int64, contiguous
//   seq_lens:         [num_seqs] int32, counting the query token (already in the cache);
//                     0 marks a padding row, whose output is zeros
//
// GQA: the `group` query heads of one KV head are handled together, so each K/V row is widened to
// fp32 once and used `group` times. Accumulation is fp32 for every input dtype. The head size is
// a template parameter for the common sizes, so the per-row loops unroll into a few vector ops.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPLITSERVE_AVX2 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxBlockSize = 128;  // CacheConfig.block_size allows 8..128
constexpr int64_t kMaxGroup = 64;       // query heads per KV head

struct Shapes {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, group, block_size, max_blocks;
  int64_t block_stride;  // elements from one block to the next in a layer's K (or V) view
  float scale;
};

// The n rows of one block (K or V of one head), widened to fp32 in `buf` [n, dim] unless they
// already are fp32 (then used in place, `stride` apart). Returns the row pointer and its stride.
template <typename T, int64_t D>
inline const float* block_as_float(const T* src, int64_t n, int64_t stride, float* __restrict buf,
                                   int64_t dim, int64_t& out_stride) {
  if constexpr (std::is_same_v<T, float>) {
    out_stride = stride;
    return src;
  } else {
    const int64_t d = D > 0 ? D : dim;
    for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) buf[t * d + i] = static_cast<float>(src[t * stride + i]);
    }
    out_stride = d;
    return buf;
  }
}

// Per-thread scratch: the group's scaled queries, one block of widened rows, the scores of the
// whole context ([group, max_len]) and the output accumulators.
struct Scratch {
  std::vector<float> q, rows, scores, acc;
  Scratch(const Shapes& s, int64_t max_len)
      : q(s.group * s.head_dim), rows(kMaxBlockSize * s.head_dim), scores(s.group * max_len),
        acc(s.group * s.head_dim) {}
};

#ifdef SPLITSERVE_AVX2
// Eight dot products at once: acc[j] holds the 8-lane partial sums of q . k_j; the result is
// the 8 horizontal sums in one register (three levels of hadd instead of eight reductions).
inline __m256 hsum8(const __m256* acc) {
  const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores[t .. t+7] = q . k_{t .. t+7} for a head size D that is a multiple of 8.
template <int64_t D>
inline void scores8(const float* __restrict q, const float* __restrict k, int64_t k_stride,
                    float* __restrict scores) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * k_stride + i), acc[j]);
  }
  _mm256_storeu_ps(scores, hsum8(acc));
}
#endif

// scores[g, t] = q_g . k_t for the n rows of one block.
template <int64_t D>
inline void block_scores(const float* __restrict q, const float* __restrict k, int64_t k_stride,
                         int64_t n, int64_t group, int64_t dim, float* __restrict scores,
                         int64_t scores_stride) {
  const int64_t d = D > 0 ? D : dim;
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    float* sg = scores + g * scores_stride;
    int64_t t = 0;
#ifdef SPLITSERVE_AVX2
    if constexpr (D > 0 && D % 8 == 0) {
      for (; t + 8 <= n; t += 8) scores8<D>(qg, k + t * k_stride, k_stride, sg + t);
    }
#endif
    for (; t < n; ++t) {
      const float* kt = k + t * k_stride;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < d; ++i) sum += qg[i] * kt[i];
      sg[t] = sum;
    }
  }
}

// acc_g += sum_t p[g, t] v_t over the n rows of one block; the accumulator stays in registers
// over t.
template <int64_t D>
inline void block_values(const float* __restrict p, int64_t p_stride, const float* __restrict v,
                         int64_t v_stride, int64_t n, int64_t group, int64_t dim,
                         float* __restrict acc) {
  const int64_t d = D > 0 ? D : dim;
  for (int64_t g = 0; g < group; ++g) {
    float* ag = acc + g * d;
    const float* pg = p + g * p_stride;
    if constexpr (D > 0) {
      float a[D];
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] = ag[i];
      for (int64_t t = 0; t < n; ++t) {
        const float w = pg[t];
        const float* vt = v + t * v_stride;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) a[i] += w * vt[i];
      }
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) ag[i] = a[i];
    } else {
      for (int64_t t = 0; t < n; ++t) {
        const float w = pg[t];
        const float* vt = v + t * v_stride;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ag[i] += w * vt[i];
      }
    }
  }
}

// Ask for the rows of the next block before they are needed: blocks sit at random places in a
// cache of gigabytes, so each one starts with misses the hardware prefetcher cannot foresee.
template <typename T>
inline void prefetch_rows(const T* rows, int64_t n, int64_t stride, int64_t dim) {
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < n; ++t) {
    const char* row = reinterpret_cast<const char*>(rows + t * stride);
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
  }
}

// scores → exp(scores - max) in place; returns their sum (the softmax denominator).
inline float softmax_numerators(float* __restrict scores, int64_t len) {
  float max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max)
  for (int64_t t = 0; t < len; ++t) max = std::max(max, scores[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    scores[t] = std::exp(scores[t] - max);
    sum += scores[t];
  }
  return sum;
}

// Two passes over the sequence's blocks: every score first, one softmax over the whole context,
// then the values. (An online softmax in one pass rescales per block; with 16-token blocks that
// per-block work cost more than the second walk, which mostly hits L1/L2.)
template <typename T, typename index_t, int64_t D>
void attend(const Shapes& s, Scratch& w, int64_t seq, int64_t kv_head, int64_t len, const T* q,
            const T* k_cache, const T* v_cache, const index_t* table, T* out) {
  const int64_t dim = D > 0 ? D : s.head_dim, G = s.group, B = s.block_size;
  const int64_t row_stride = s.num_kv_heads * dim;  // token to token inside a block
  const int64_t q_off = (seq * s.num_heads + kv_head * G) * dim;  // the group's first head
  const int64_t num_blocks = (len + B - 1) / B;
  for (int64_t i = 0; i < G * dim; ++i) w.q[i] = static_cast<float>(q[q_off + i]) * s.scale;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t offset = static_cast<int64_t>(table[b]) * s.block_stride + kv_head * dim;
    const int64_t n = std::min(B, len - b * B);
    if (b + 1 < num_blocks) {
      const int64_t next = static_cast<int64_t>(table[b + 1]) * s.block_stride + kv_head * dim;
      prefetch_rows(k_cache + next, std::min(B, len - (b + 1) * B), row_stride, dim);
    }
    int64_t stride = 0;
    const float* k = block_as_float<T, D>(k_cache + offset, n, row_stride, w.rows.data(), dim, stride);
    block_scores<D>(w.q.data(), k, stride, n, G, dim, w.scores.data() + b * B, len);
  }
  prefetch_rows(v_cache + static_cast<int64_t>(table[0]) * s.block_stride + kv_head * dim,
                std::min(B, len), row_stride, dim);
  float inv_sum[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) inv_sum[g] = 1.f / softmax_numerators(&w.scores[g * len], len);
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t offset = static_cast<int64_t>(table[b]) * s.block_stride + kv_head * dim;
    const int64_t n = std::min(B, len - b * B);
    if (b + 1 < num_blocks) {
      const int64_t next = static_cast<int64_t>(table[b + 1]) * s.block_stride + kv_head * dim;
      prefetch_rows(v_cache + next, std::min(B, len - (b + 1) * B), row_stride, dim);
    }
    int64_t stride = 0;
    const float* v = block_as_float<T, D>(v_cache + offset, n, row_stride, w.rows.data(), dim, stride);
    block_values<D>(w.scores.data() + b * B, len, v, stride, n, G, dim, w.acc.data());
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < dim; ++i) {
      out[q_off + g * dim + i] = static_cast<T>(w.acc[g * dim + i] * inv_sum[g]);
    }
  }
}

template <typename T, typename index_t, int64_t D>
void decode(const Shapes& s, const T* q, const T* k_cache, const T* v_cache,
            const index_t* block_tables, const int32_t* seq_lens, T* out) {
  const int64_t work = s.num_seqs * s.num_kv_heads;
  // Contexts differ in length, so items are handed out one at a time from a shared counter
  // (dynamic scheduling) rather than split into equal static ranges.
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work));
  const int64_t max_len = *std::max_element(seq_lens, seq_lens + s.num_seqs);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch(s, max_len);
    for (int64_t item = next++; item < work; item = next++) {
      const int64_t seq = item / s.num_kv_heads, kv_head = item % s.num_kv_heads;
      const int64_t len = seq_lens[seq];
      if (len <= 0) {
        T* o = out + (seq * s.num_heads + kv_head * s.group) * s.head_dim;
        std::fill(o, o + s.group * s.head_dim, static_cast<T>(0.f));
        continue;
      }
      attend<T, index_t, D>(s, scratch, seq, kv_head, len, q, k_cache, v_cache,
                            block_tables + seq * s.max_blocks, out);
    }
  });
}

template <typename T, typename index_t>
void decode_any_dim(const Shapes& s, const at::Tensor& q, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& tables,
                    const at::Tensor& seq_lens, at::Tensor& out) {
  auto run = [&](auto dim) {
    decode<T, index_t, decltype(dim)::value>(
        s, q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
        tables.data_ptr<index_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<T>());
  };
  switch (s.head_dim) {
    case 32: return run(std::integral_constant<int64_t, 32>{});
    case 64: return run(std::integral_constant<int64_t, 64>{});
    case 128: return run(std::integral_constant<int64_t, 128>{});
    default: return run(std::integral_constant<int64_t, 0>{});
  }
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [S, Hq, D]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.dtype() == q.dtype(),
              "out must be a contiguous tensor shaped and typed like q");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.strides() == k_cache.strides(),
              "k_cache/v_cache must be equal [num_blocks, block_size, Hkv, D] views");
  TORCH_CHECK(k_cache.dtype() == q.dtype() && v_cache.dtype() == q.dtype(),
              "q, k_cache and v_cache must share one dtype");
  const int64_t D = k_cache.size(3), H = k_cache.size(2), B = k_cache.size(1);
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == D && k_cache.stride(1) == H * D,
              "each block of k_cache/v_cache must be a dense [block_size, Hkv, D]");
  TORCH_CHECK(B <= kMaxBlockSize, "block_size above ", kMaxBlockSize);
  TORCH_CHECK(q.size(2) == D && q.size(1) % H == 0, "q heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(1) / H <= kMaxGroup, "more than ", kMaxGroup, " query heads per KV head");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  block_tables.is_contiguous(),
              "block_tables must be a contiguous [S, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) && seq_lens.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt,
              "seq_lens must be a contiguous int32 [S]");
  const Shapes s{q.size(0), q.size(1), H, D, q.size(1) / H, B, block_tables.size(1),
                 k_cache.stride(0), static_cast<float>(scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (block_tables.scalar_type() == at::kLong) {
      decode_any_dim<scalar_t, int64_t>(s, q, k_cache, v_cache, block_tables, seq_lens, out);
    } else {
      TORCH_CHECK(block_tables.scalar_type() == at::kInt, "block_tables must be int32 or int64");
      decode_any_dim<scalar_t, int32_t>(s, q, k_cache, v_cache, block_tables, seq_lens, out);
    }
  });
}

}  // namespace

TORCH_LIBRARY(splitserve_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
