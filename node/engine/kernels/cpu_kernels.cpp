// Float32 kernels for the few-token forwards of a resumed prompt on one CPU thread (AVX-512).
//
// A resumed prompt runs its new tokens (tens, not thousands) through every weight once: the matrices
// come from memory cold, and a library GEMM that first packs them and then computes leaves the memory
// stream and the arithmetic serial. Here weights are packed once at load time into contiguous panels
// and each GEMM prefetches the next panel while it computes on this one. Attention of a few queries
// over a long cached history runs queries across the vector lanes, so keys stream once per head.
//
// Layouts are written next to each function; every pointer is float32, every stride in elements. Prefetches
// never fault, so a prefetch past the end of a buffer is harmless.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int64_t NR = 32;  // panel width: two vectors of output columns
constexpr int64_t MR = 64;  // rows of A handled per block
constexpr int MAX_TILE = 12;  // rows per register tile: 12 x 2 accumulators

inline __m512 exp512(__m512 x) {
  // exp(x) = 2^n * 2^f, n = round(x log2 e), |f| <= 0.5, 2^f by its Taylor series to degree 7
  // (relative error about 1e-7 over the range); below -87 the result is exactly 0.
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

// Flushes denormal inputs and results to zero while alive: the weights of keys far below the maximum
// score underflow, and each arithmetic step on a denormal costs a microcode assist of ~100 cycles.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// Scratch memory of the calling thread, kept between calls so that large buffers do not page-fault
// on every call.
float* scratch(int64_t floats) {
  static thread_local float* buffer = nullptr;
  static thread_local int64_t held = 0;
  if (floats > held) {
    free(buffer);
    held = floats + floats / 2;
    buffer = static_cast<float*>(aligned_alloc(64, ((held * 4 + 63) / 64) * 64));
  }
  return buffer;
}

// C[R rows, 32 cols] (=|+=) At[k, R] . panel[k, 32], k over all K. At holds A transposed, MR floats a
// row. While computing, tile `ti` of `nt` prefetches every nt-th row of the next panel.
template <int R>
void gemm_tile(const float* At, const float* panel, int64_t K, float* C, int64_t ldc, __mmask16 m0, __mmask16 m1,
               bool accumulate, const float* bias, const float* next, int ti, int nt) {
  __m512 c0[R], c1[R];
  for (int r = 0; r < R; r++) {
    c0[r] = accumulate ? _mm512_maskz_loadu_ps(m0, C + r * ldc) : _mm512_setzero_ps();
    c1[r] = accumulate ? _mm512_maskz_loadu_ps(m1, C + r * ldc + 16) : _mm512_setzero_ps();
  }
  int phase = nt - ti;  // counts down to the rows of `next` this tile prefetches: every nt-th from ti
  for (int64_t k = 0; k < K; k++) {
    __m512 b0 = _mm512_load_ps(panel + k * NR), b1 = _mm512_load_ps(panel + k * NR + 16);
    if (--phase == 0) {
      phase = nt;
      if (next) {
        _mm_prefetch(reinterpret_cast<const char*>(next + k * NR), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next + k * NR + 16), _MM_HINT_T1);
      }
    }
    const float* a = At + k * MR;
    for (int r = 0; r < R; r++) {
      __m512 av = _mm512_set1_ps(a[r]);
      c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
    }
  }
  __m512 bias0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  __m512 bias1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; r++) {
    _mm512_mask_storeu_ps(C + r * ldc, m0, _mm512_add_ps(c0[r], bias0));
    _mm512_mask_storeu_ps(C + r * ldc + 16, m1, _mm512_add_ps(c1[r], bias1));
  }
}

using gemm_tile_fn = void (*)(const float*, const float*, int64_t, float*, int64_t, __mmask16, __mmask16, bool,
                              const float*, const float*, int, int);
const gemm_tile_fn GEMM_TILES[MAX_TILE + 1] = {
    nullptr, gemm_tile<1>, gemm_tile<2>, gemm_tile<3>, gemm_tile<4>, gemm_tile<5>, gemm_tile<6>,
    gemm_tile<7>, gemm_tile<8>, gemm_tile<9>, gemm_tile<10>, gemm_tile<11>, gemm_tile<12>};

// S[j, TV*16] = sum_d K[j, d] * qT[d, TV*16] for R keys from `keys` (row stride kv_sl); mx takes the
// running maximum per query lane.
// The same rows of `upcoming_keys` (to L1) and `values` (to L2) are prefetched a line per step of d, so
// the requests trickle out with the arithmetic instead of queueing in a burst (R * D / 16 <= D lines).
template <int R, int TV>
void score_tile(const float* qT, int64_t D, const float* keys, int64_t kv_sl, float* S, __m512* mx,
                const float* upcoming_keys, const float* values) {
  __m512 acc[R][TV];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < TV; v++) acc[r][v] = _mm512_setzero_ps();
  const int64_t lines_per_row = D / 16, prefetched = upcoming_keys ? R * lines_per_row : 0;
  for (int64_t d = 0; d < D; d++) {
    if (d < prefetched) {
      const int64_t offset = (d / lines_per_row) * kv_sl + (d % lines_per_row) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(upcoming_keys + offset), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(values + offset), _MM_HINT_T1);
    }
    __m512 qv[TV];
    for (int v = 0; v < TV; v++) qv[v] = _mm512_load_ps(qT + d * TV * 16 + v * 16);
    for (int r = 0; r < R; r++) {
      __m512 kb = _mm512_set1_ps(keys[r * kv_sl + d]);
      for (int v = 0; v < TV; v++) acc[r][v] = _mm512_fmadd_ps(kb, qv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < TV; v++) {
      _mm512_store_ps(S + r * TV * 16 + v * 16, acc[r][v]);
      mx[v] = _mm512_max_ps(mx[v], acc[r][v]);
    }
}

// O[RT queries, DV*16] (=|+=) sum_j P[j, t] * V[j, DV*16] over keys [j0, j1), P key-major with TP floats a
// key. While it runs, `ahead` rows j of another [L, D] block are prefetched into L2.
template <int RT, int DV>
void value_tile(const float* P, int64_t TP, int64_t j0, int64_t j1, const float* values, int64_t kv_sl, float* O,
                int64_t o_st, bool first, const float* ahead) {
  __m512 acc[RT][DV];
  for (int r = 0; r < RT; r++)
    for (int v = 0; v < DV; v++) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(O + r * o_st + v * 16);
  for (int64_t j = j0; j < j1; j++) {
    if (ahead)
      for (int v = 0; v < DV; v++) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * kv_sl + v * 16), _MM_HINT_T1);
    __m512 vv[DV];
    for (int v = 0; v < DV; v++) vv[v] = _mm512_loadu_ps(values + j * kv_sl + v * 16);
    for (int r = 0; r < RT; r++) {
      __m512 pb = _mm512_set1_ps(P[j * TP + r]);
      for (int v = 0; v < DV; v++) acc[r][v] = _mm512_fmadd_ps(pb, vv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RT; r++)
    for (int v = 0; v < DV; v++) _mm512_storeu_ps(O + r * o_st + v * 16, acc[r][v]);
}

constexpr int KEY_TILE = 12;
constexpr int64_t KEYS_AHEAD = 48;  // keys prefetched ahead of the score tile (prefetches past the end are harmless)
using score_fn = void (*)(const float*, int64_t, const float*, int64_t, float*, __m512*, const float*, const float*);
const score_fn SCORE_FULL[5] = {nullptr, score_tile<KEY_TILE, 1>, score_tile<KEY_TILE, 2>, score_tile<8, 3>,
                                score_tile<6, 4>};
const int SCORE_ROWS[5] = {0, KEY_TILE, KEY_TILE, 8, 6};
const score_fn SCORE_ONE[5] = {nullptr, score_tile<1, 1>, score_tile<1, 2>, score_tile<1, 3>, score_tile<1, 4>};

constexpr int64_t VALUE_BLOCK = 64;  // keys whose values and weights stay in L1 across the query tiles

template <int DV>
void values_for_head(const float* P, int64_t TP, int64_t T, int64_t L, const float* values, int64_t kv_sl, float* O,
                     int64_t o_st, const float* ahead, bool first) {
  constexpr int RT = 24 / DV;
  for (int64_t j0 = 0; j0 < L; j0 += VALUE_BLOCK) {
    const int64_t j1 = j0 + VALUE_BLOCK < L ? j0 + VALUE_BLOCK : L;
    int64_t t = 0;
    for (; t + RT <= T; t += RT)
      value_tile<RT, DV>(P + t, TP, j0, j1, values, kv_sl, O + t * o_st, o_st, first && j0 == 0,
                         t == 0 ? ahead : nullptr);
    for (; t < T; t++)
      value_tile<1, DV>(P + t, TP, j0, j1, values, kv_sl, O + t * o_st, o_st, first && j0 == 0, t == 0 ? ahead : nullptr);
  }
}

}  // namespace

extern "C" {

int64_t tz_packed_floats(int64_t K, int64_t N) { return ((N + NR - 1) / NR) * K * NR; }

// out[panel, k, 32] <- W[n, k] with W's element (n, k) at W[n * stride_n + k * stride_k]; the columns past N
// in the last panel are zero. `out` must be 64-byte aligned.
void tz_pack(const float* W, int64_t K, int64_t N, int64_t stride_n, int64_t stride_k, float* out) {
  const int64_t panels = (N + NR - 1) / NR;
  for (int64_t p = 0; p < panels; p++)
    for (int64_t k = 0; k < K; k++) {
      float* dst = out + (p * K + k) * NR;
      for (int64_t j = 0; j < NR; j++) {
        const int64_t n = p * NR + j;
        dst[j] = n < N ? W[n * stride_n + k * stride_k] : 0.0f;
      }
    }
}

// C[M, N] = A[M, K] . B + bias (or C += when accumulate), B packed by tz_pack. Rows of A and C are lda
// and ldc apart; bias may be null. `then` (may be null) is what the caller reads next: its first K * 32
// floats are prefetched during the last panel, so the next kernel does not start on cold memory.
void tz_gemm(const float* A, int64_t M, int64_t K, int64_t lda, const float* packed, int64_t N, float* C,
             int64_t ldc, const float* bias, int accumulate, const float* then) {
  float* At = scratch(K * MR);
  const int64_t panels = (N + NR - 1) / NR;
  for (int64_t m0 = 0; m0 < M; m0 += MR) {
    const int64_t rows = M - m0 < MR ? M - m0 : MR;
    // k outer: the writes run along At's rows and each row of A stays in L1 for 16 steps of k.
    for (int64_t k = 0; k < K; k++)
      for (int64_t i = 0; i < rows; i++) At[k * MR + i] = A[(m0 + i) * lda + k];
    const int nt = static_cast<int>((rows + MAX_TILE - 1) / MAX_TILE);
    for (int64_t p = 0; p < panels; p++) {
      const float* panel = packed + p * K * NR;
      const float* next = p + 1 < panels ? panel + K * NR : (m0 + MR >= M ? then : nullptr);
      const int64_t n0 = p * NR, width = N - n0 < NR ? N - n0 : NR;
      const __mmask16 m0mask = lanes(width), m1mask = width > 16 ? lanes(width - 16) : 0;
      int64_t i = 0;
      for (int ti = 0; ti < nt; ti++) {
        const int64_t r = (rows - i) / (nt - ti);  // tiles of nearly equal height
        GEMM_TILES[r](At + i, panel, K, C + (m0 + i) * ldc + n0, ldc, m0mask, m1mask, accumulate != 0,
                      bias ? bias + n0 : nullptr, next, ti, nt);
        i += r;
      }
    }
  }
}

// Causal attention of T queries at positions start..start+T-1 over keys 0..L-1 (L = start + T), for H
// query heads sharing Hkv key/value heads (grouped-query attention), head dim D (32, 64 or 128).
// q[t, h, d] at q + t * q_st + h * D + d; out[t, h, d] at out + t * o_st + h * D + d. The keys and values
// come in `segments` pieces that follow each other in position order (a stored prefix need not be copied
// next to the new tokens first): piece s holds seg_len[s] rows [Hkv, seg_len[s], D], key head g of
// piece s at seg_keys[s] + g * seg_head_stride[s], rows D floats apart. T at most 64; returns -1 for a
// shape it does not take. `then` (may be null) is what the caller reads next: it starts streaming in
// during the last head.
int tz_attention(const float* q, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t q_st, int segments,
                 const float* const* seg_keys, const float* const* seg_values, const int64_t* seg_head_stride,
                 const int64_t* seg_len, int64_t start, float scale, float* out, int64_t o_st, const float* then) {
  if ((D != 32 && D != 64 && D != 128) || T < 1 || T > 64 || segments < 1) return -1;
  int64_t L = 0;
  for (int s = 0; s < segments; s++) L += seg_len[s];
  if (L != start + T) return -1;
  FlushDenormals flush;
  const int TV = static_cast<int>((T + 15) / 16);
  const int64_t TP = TV * 16;
  float* qT = scratch(D * TP + L * TP);
  float* S = qT + D * TP;
  const int64_t group = H / Hkv;
  const int rows = SCORE_ROWS[TV];
  for (int64_t h = 0; h < H; h++) {
    const int64_t g = h / group;
    for (int64_t d = 0; d < D; d++)
      for (int64_t t = 0; t < TP; t++) qT[d * TP + t] = t < T ? q[t * q_st + h * D + d] * scale : 0.0f;
    // Scores, key-major: S[j, t]. The causal part (keys past `start`) is masked before its maximum is
    // taken, so it is scored one key at a time. Keys KEYS_AHEAD ahead go to L1; this head's values, read
    // after the softmax, to L2.
    __m512 mx[4], sum[4], ignored[4];
    for (int v = 0; v < TV; v++) { mx[v] = _mm512_set1_ps(-__builtin_inff()); sum[v] = _mm512_setzero_ps(); }
    for (int64_t s = 0, base = 0; s < segments; base += seg_len[s], s++) {
      const float* keys = seg_keys[s] + g * seg_head_stride[s];
      const float* values = seg_values[s] + g * seg_head_stride[s];
      const int64_t unmasked = start + 1 - base < seg_len[s] ? start + 1 - base : seg_len[s];
      int64_t j = 0;
      for (; j + rows <= unmasked; j += rows)
        SCORE_FULL[TV](qT, D, keys + j * D, D, S + (base + j) * TP, mx, keys + (j + KEYS_AHEAD) * D, values + j * D);
      for (; j < seg_len[s]; j++) {
        float* row = S + (base + j) * TP;
        SCORE_ONE[TV](qT, D, keys + j * D, D, row, ignored, nullptr, nullptr);
        for (int64_t t = 0; t < base + j - start && t < TP; t++) row[t] = -__builtin_inff();  // t sees j <= start + t
        for (int v = 0; v < TV; v++) mx[v] = _mm512_max_ps(mx[v], _mm512_load_ps(row + v * 16));
      }
    }
    for (int64_t j = 0; j < L; j++)
      for (int v = 0; v < TV; v++) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(S + j * TP + v * 16), mx[v]));
        _mm512_store_ps(S + j * TP + v * 16, e);
        sum[v] = _mm512_add_ps(sum[v], e);
      }
    float inv[64];
    for (int v = 0; v < TV; v++) _mm512_storeu_ps(inv + v * 16, _mm512_div_ps(_mm512_set1_ps(1.0f), sum[v]));
    float* o = out + h * D;
    // While the values are summed, the next key head streams into L2 (one 64-byte line per key and 16 dims).
    const bool last = h + 1 == H, next_group = (h + 1) % group == 0;
    for (int64_t s = 0, base = 0; s < segments; base += seg_len[s], s++) {
      const float* values = seg_values[s] + g * seg_head_stride[s];
      const float* ahead = last ? (then ? then + base * D : nullptr)
                                : next_group ? seg_keys[s] + (g + 1) * seg_head_stride[s] : nullptr;
      const float* P = S + base * TP;
      if (D == 64) values_for_head<4>(P, TP, T, seg_len[s], values, D, o, o_st, ahead, s == 0);
      else if (D == 128) values_for_head<8>(P, TP, T, seg_len[s], values, D, o, o_st, ahead, s == 0);
      else values_for_head<2>(P, TP, T, seg_len[s], values, D, o, o_st, ahead, s == 0);
    }
    for (int64_t t = 0; t < T; t++)
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(o + t * o_st + d, _mm512_mul_ps(_mm512_loadu_ps(o + t * o_st + d), _mm512_set1_ps(inv[t])));
  }
  return 0;
}

// out[t, :] = w * x[t, :] / sqrt(mean(x[t, :]^2) + eps), as Llama's RMSNorm in float32.
void tz_rmsnorm(const float* x, int64_t T, int64_t N, int64_t ldx, const float* w, float eps, float* out,
                int64_t ldo) {
  for (int64_t t = 0; t < T; t++) {
    const float* row = x + t * ldx;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t n = 0; n < N; n += 16) {
      __m512 v = _mm512_maskz_loadu_ps(lanes(N - n), row + n);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(N);
    const __m512 scale = _mm512_set1_ps(1.0f / __builtin_sqrtf(mean + eps));
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 m = lanes(N - n);
      __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + n), scale);
      _mm512_mask_storeu_ps(out + t * ldo + n, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + n), v));
    }
  }
}

// Rotary embedding in place on `heads` heads of dim D per row: x = x * cos + rotate_half(x) * sin, with
// cos/sin [T, D] and rotate_half(x) = (-x[D/2:], x[:D/2]). Rows are ldx apart; heads D apart.
void tz_rope(float* x, int64_t T, int64_t heads, int64_t D, int64_t ldx, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < heads; h++) {
      float* v = x + t * ldx + h * D;
      const float* c = cos + t * D;
      const float* s = sin + t * D;
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = lanes(half - i);
        __m512 a = _mm512_maskz_loadu_ps(m, v + i), b = _mm512_maskz_loadu_ps(m, v + half + i);
        __m512 ra = _mm512_sub_ps(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, c + i)),
                                  _mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, s + i)));
        __m512 rb = _mm512_add_ps(_mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, c + half + i)),
                                  _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, s + half + i)));
        _mm512_mask_storeu_ps(v + i, m, ra);
        _mm512_mask_storeu_ps(v + half + i, m, rb);
      }
    }
}

// out[t, i] = silu(gu[t, i]) * gu[t, I + i]: the gated MLP's activation on the fused gate/up product.
void tz_silu_mul(const float* gu, int64_t T, int64_t I, float* out) {
  FlushDenormals flush;
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = lanes(I - i);
      __m512 g = _mm512_maskz_loadu_ps(m, gu + t * 2 * I + i), u = _mm512_maskz_loadu_ps(m, gu + t * 2 * I + I + i);
      __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_mask_storeu_ps(out + t * I + i, m, _mm512_mul_ps(silu, u));
    }
}

}  // extern "C"
