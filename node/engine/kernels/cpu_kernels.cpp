// Float32 kernels for the few-token forwards of a resumed prompt on one CPU thread (AVX-512), and for the
// attention of a batched decode step, where each row's one query reads its own cold history (tz_decode_attention).
//
// A resumed prompt runs its new tokens (tens, not thousands) through every weight once: the matrices
// come from memory cold, and a library GEMM that first packs them and then computes leaves the memory
// stream and the arithmetic serial. Here weights are packed once at load time into contiguous panels
// and each GEMM prefetches a panel further on while it computes on this one. Attention of a few queries
// over a long cached history runs queries across the vector lanes in one pass per head (an online softmax),
// so keys and values stream once, a few blocks ahead of the arithmetic.
//
// Layouts are written next to each function; every pointer is float32, every stride in elements. Prefetches
// never fault, so a prefetch past the end of a buffer is harmless.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int64_t NR = 32;  // panel width: two vectors of output columns
constexpr int64_t MR = 64;  // rows of A handled per block
constexpr int MAX_TILE = 12;  // rows per register tile: 12 x 2 accumulators
constexpr int64_t PANELS_AHEAD = 1;  // a GEMM computes on one panel while this one further on streams in
constexpr int64_t ROWS_AHEAD = 4;    // and pulls the rows of its panel a few steps ahead from L2 into L1
constexpr int64_t SCREEN_AHEAD = 4;  // panels of a head's int8 screen (a quarter of a float32 panel each)

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

// exp(x) for x <= 0 (or -inf), denormals flushed: 2^n * 2^f with n = round(x log2 e), |f| <= 0.5, 2^f by
// its Taylor series to degree 7 (relative error about 1e-7); far below the maximum the result is 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);  // ln2^7 / 7!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428441e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
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

// C[R rows, 32 cols] (=|+=) At[k, R] . panel[k, 32], k over all K. At holds A transposed, `lat` floats a
// row. Every `every` steps of k it also prefetches the next 32 floats of `pf` (none when null).
template <int R>
void gemm_tile(const float* At, int64_t lat, const float* panel, int64_t K, float* C, int64_t ldc, __mmask16 m0,
               __mmask16 m1, bool accumulate, const float* bias, const float* pf, int every) {
  __m512 c0[R], c1[R];
  for (int r = 0; r < R; r++) {
    c0[r] = accumulate ? _mm512_maskz_loadu_ps(m0, C + r * ldc) : _mm512_setzero_ps();
    c1[r] = accumulate ? _mm512_maskz_loadu_ps(m1, C + r * ldc + 16) : _mm512_setzero_ps();
  }
  int phase = every;
  for (int64_t k = 0; k < K; k++) {
    __m512 b0 = _mm512_load_ps(panel + k * NR), b1 = _mm512_load_ps(panel + k * NR + 16);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + ROWS_AHEAD) * NR), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + ROWS_AHEAD) * NR + 16), _MM_HINT_T0);
    if (--phase == 0) {
      phase = every;
      if (pf) {
        _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(pf + 16), _MM_HINT_T1);
        pf += NR;
      }
    }
    const float* a = At + k * lat;
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

// At[k, i] = A[i, k] for 16 rows of A (lda apart) and K columns, At rows `lat` apart: 16 x 16 blocks
// transposed in registers; columns past the last multiple of 16 one by one.
void transpose16(const float* A, int64_t lda, int64_t K, float* At, int64_t lat) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(A + i * lda + k);
    // Interleave pairs, then quadruples, then 128-bit lanes twice: r[i] ends up holding column i.
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
      r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
      r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
      r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 4; i++) {
      t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
      t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
      t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
      t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
      r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
      r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(At + (k + i) * lat, r[i]);
  }
  for (; k < K; k++)
    for (int64_t i = 0; i < 16; i++) At[k * lat + i] = A[i * lda + k];
}

using gemm_tile_fn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, __mmask16, __mmask16,
                              bool, const float*, const float*, int);
const gemm_tile_fn GEMM_TILES[MAX_TILE + 1] = {
    nullptr, gemm_tile<1>, gemm_tile<2>, gemm_tile<3>, gemm_tile<4>, gemm_tile<5>, gemm_tile<6>,
    gemm_tile<7>, gemm_tile<8>, gemm_tile<9>, gemm_tile<10>, gemm_tile<11>, gemm_tile<12>};

// S[j, TV*16] = sum_d K[j, d] * qT[d, TV*16] for R keys from `keys` (rows D floats apart); mx takes the
// running maximum per query lane. Every step of d also prefetches one line of `pf` (pf_lines in all), so
// the next blocks' keys stream in with the arithmetic instead of queueing in a burst.
template <int R, int TV>
void score_tile(const float* qT, int64_t D, const float* keys, float* S, __m512* mx, const float* pf, int64_t pf_lines) {
  __m512 acc[R][TV];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < TV; v++) acc[r][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d++) {
    if (d < pf_lines) _mm_prefetch(reinterpret_cast<const char*>(pf + d * 16), _MM_HINT_T1);
    __m512 qv[TV];
    for (int v = 0; v < TV; v++) qv[v] = _mm512_load_ps(qT + d * TV * 16 + v * 16);
    for (int r = 0; r < R; r++) {
      __m512 kb = _mm512_set1_ps(keys[r * D + d]);
      for (int v = 0; v < TV; v++) acc[r][v] = _mm512_fmadd_ps(kb, qv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < TV; v++) {
      _mm512_store_ps(S + r * TV * 16 + v * 16, acc[r][v]);
      mx[v] = _mm512_max_ps(mx[v], acc[r][v]);
    }
}

// O[RT queries, DV*16] = O * alpha[t] + sum_j P[j, t] * V[j, DV*16] over the n keys of a block (or = the sum
// alone when `first`), P key-major with TP floats a key. Every key also prefetches one line of `pf`.
template <int RT, int DV>
void value_tile(const float* P, int64_t TP, int64_t n, const float* values, float* O, int64_t o_st,
                const float* alpha, bool first, const float* pf, int64_t pf_lines) {
  __m512 acc[RT][DV];
  for (int r = 0; r < RT; r++) {
    const __m512 a = _mm512_set1_ps(first ? 0.0f : alpha[r]);
    for (int v = 0; v < DV; v++)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_loadu_ps(O + r * o_st + v * 16), a);
  }
  for (int64_t j = 0; j < n; j++) {
    if (j < pf_lines) _mm_prefetch(reinterpret_cast<const char*>(pf + j * 16), _MM_HINT_T1);
    __m512 vv[DV];
    for (int v = 0; v < DV; v++) vv[v] = _mm512_loadu_ps(values + j * DV * 16 + v * 16);
    for (int r = 0; r < RT; r++) {
      __m512 pb = _mm512_set1_ps(P[j * TP + r]);
      for (int v = 0; v < DV; v++) acc[r][v] = _mm512_fmadd_ps(pb, vv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RT; r++)
    for (int v = 0; v < DV; v++) _mm512_storeu_ps(O + r * o_st + v * 16, acc[r][v]);
}

using score_fn = void (*)(const float*, int64_t, const float*, float*, __m512*, const float*, int64_t);
const score_fn SCORE_FULL[5] = {nullptr, score_tile<12, 1>, score_tile<12, 2>, score_tile<8, 3>, score_tile<6, 4>};
const int SCORE_ROWS[5] = {0, 12, 12, 8, 6};
const score_fn SCORE_FOUR[5] = {nullptr, score_tile<4, 1>, score_tile<4, 2>, score_tile<4, 3>, score_tile<4, 4>};
const score_fn SCORE_ONE[5] = {nullptr, score_tile<1, 1>, score_tile<1, 2>, score_tile<1, 3>, score_tile<1, 4>};

constexpr int64_t BLOCK = 48;  // keys per step of the online softmax: a multiple of every SCORE_ROWS
constexpr int64_t AHEAD = 2;  // blocks between the one computed and the one prefetched

// s[r, 0..width) = scale * sum_k codes[k, column] * x[r, k] (+ bias) for R rows of x (x_st floats apart) and
// one panel of an output head's screen: int8 codes [K, 32] of each row's weights over a per-row scale. Each
// code is widened once for all R rows. One line of `pf` (null: none) is prefetched every other step of k, which
// is the rate one row reads the codes at.
template <int R>
void screen_rows(const float* x, int64_t x_st, int64_t K, const int8_t* codes, const float* scale, const float* bias,
                 int64_t width, float* out, int64_t out_st, const int8_t* pf) {
  const __mmask16 m0 = lanes(width), m1 = width > 16 ? lanes(width - 16) : 0;
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    if (pf && k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(pf + k * NR), _MM_HINT_T1);
    const __m256i c = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes + k * NR));
    const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c)));
    const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1)));
    for (int r = 0; r < R; r++) {
      const __m512 xr = _mm512_set1_ps(x[r * x_st + k]);
      a0[r] = _mm512_fmadd_ps(c0, xr, a0[r]);
      a1[r] = _mm512_fmadd_ps(c1, xr, a1[r]);
    }
  }
  const __m512 k0 = _mm512_maskz_loadu_ps(m0, scale), k1 = _mm512_maskz_loadu_ps(m1, scale + 16);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; r++) {
    _mm512_mask_storeu_ps(out + r * out_st, m0, _mm512_add_ps(_mm512_mul_ps(a0[r], k0), b0));
    _mm512_mask_storeu_ps(out + r * out_st + 16, m1, _mm512_add_ps(_mm512_mul_ps(a1[r], k1), b1));
  }
}

constexpr int SCREEN_ROWS = 8;  // rows of x per pass over a panel: 16 accumulators
using screen_fn = void (*)(const float*, int64_t, int64_t, const int8_t*, const float*, const float*, int64_t, float*,
                           int64_t, const int8_t*);
const screen_fn SCREENS[SCREEN_ROWS + 1] = {nullptr,         screen_rows<1>, screen_rows<2>, screen_rows<3>,
                                            screen_rows<4>,  screen_rows<5>, screen_rows<6>, screen_rows<7>,
                                            screen_rows<8>};

constexpr int below(int rows, int limit) { return rows < limit ? rows : 1; }

// The values of one block for every query: tiles of RT queries, the remainder in one smaller tile.
template <int DV>
void block_values(const float* P, int64_t TP, int64_t T, int64_t n, const float* values, float* O, int64_t o_st,
                  const float* alpha, bool first, const float* pf, int64_t pf_lines) {
  constexpr int RT = 24 / DV;
  using value_fn = void (*)(const float*, int64_t, int64_t, const float*, float*, int64_t, const float*, bool,
                            const float*, int64_t);
  static const value_fn REST[12] = {  // by the queries left after the full tiles: only [1, RT) occur
      nullptr, value_tile<1, DV>, value_tile<below(2, RT), DV>, value_tile<below(3, RT), DV>,
      value_tile<below(4, RT), DV>, value_tile<below(5, RT), DV>, value_tile<below(6, RT), DV>,
      value_tile<below(7, RT), DV>, value_tile<below(8, RT), DV>, value_tile<below(9, RT), DV>,
      value_tile<below(10, RT), DV>, value_tile<below(11, RT), DV>};
  int64_t t = 0;
  for (; t + RT <= T; t += RT) {
    value_tile<RT, DV>(P + t, TP, n, values, O + t * o_st, o_st, alpha + t, first, pf, pf_lines);
    pf += n * 16, pf_lines -= n;
  }
  if (t < T) REST[T - t](P + t, TP, n, values, O + t * o_st, o_st, alpha + t, first, pf, pf_lines);
}

// A run of key/value rows that the attention reads in order: one block of one head of one piece.
struct Block {
  const float* keys;
  const float* values;
  int64_t rows;
  int64_t position;  // of the first row
};

}  // namespace

// The sum of a vector's lanes.
inline float lane_sum(__m512 v) {
  const __m256 x = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 z = _mm_add_ps(y, _mm_movehl_ps(y, y));
  return _mm_cvtss_f32(_mm_add_ss(z, _mm_movehdup_ps(z)));
}

// Row j of a row-major [n, LINES * 16] matrix M into r, prefetching every line of the row 16 further on.
template <int LINES>
inline void load_row_ahead(const float* M, int64_t j, __m512* r) {
  constexpr int64_t D = LINES * 16, AHEAD_ROWS = 16;
  for (int l = 0; l < LINES; l++)
    _mm_prefetch(reinterpret_cast<const char*>(M + (j + AHEAD_ROWS) * D + l * 16), _MM_HINT_T0);
  for (int l = 0; l < LINES; l++) r[l] = _mm512_loadu_ps(M + j * D + l * 16);
}

// Scores S[q * n + j] = qs_q . k_j of QB scaled queries qs [QB, LINES * 16] against n key rows K, each key row
// loaded once for all QB; top[q] gets each query's largest score.
template <int LINES, int QB>
void score_rows(const float* qs, const float* K, int64_t n, float* S, float* top) {
  constexpr int64_t D = LINES * 16;
  __m512 qv[QB][LINES];
  for (int q = 0; q < QB; q++)
    for (int l = 0; l < LINES; l++) qv[q][l] = _mm512_load_ps(qs + q * D + l * 16);
  float mx[QB];
  for (int q = 0; q < QB; q++) mx[q] = -__builtin_inff();
  for (int64_t j = 0; j < n; j++) {
    __m512 kv[LINES];
    load_row_ahead<LINES>(K, j, kv);
    for (int q = 0; q < QB; q++) {
      __m512 a = _mm512_mul_ps(qv[q][0], kv[0]);
      for (int l = 1; l < LINES; l++) a = _mm512_fmadd_ps(qv[q][l], kv[l], a);
      const float score = lane_sum(a);
      S[q * n + j] = score;
      mx[q] = fmaxf(mx[q], score);
    }
  }
  for (int q = 0; q < QB; q++) top[q] = mx[q];
}

// o[q] = sum_j P[q * p_q + j * p_j] v_j / total[q] for QB queries over n value rows V, each row loaded once for
// all QB.
template <int LINES, int QB>
void weigh_rows(const float* P, int64_t p_q, int64_t p_j, const float* V, int64_t n, const float* total, float* o) {
  constexpr int64_t D = LINES * 16;
  __m512 acc[QB][LINES];
  for (int q = 0; q < QB; q++)
    for (int l = 0; l < LINES; l++) acc[q][l] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j++) {
    __m512 vv[LINES];
    load_row_ahead<LINES>(V, j, vv);
    for (int q = 0; q < QB; q++) {
      const __m512 p = _mm512_set1_ps(P[q * p_q + j * p_j]);
      for (int l = 0; l < LINES; l++) acc[q][l] = _mm512_fmadd_ps(p, vv[l], acc[q][l]);
    }
  }
  for (int q = 0; q < QB; q++) {
    const __m512 inv = _mm512_set1_ps(1.0f / total[q]);
    for (int l = 0; l < LINES; l++) _mm512_storeu_ps(o + q * D + l * 16, _mm512_mul_ps(acc[q][l], inv));
  }
}

// One key/value head of tz_decode_attention: `group` scaled queries qs [group, LINES * 16] over n rows of keys K
// and values V (LINES * 16 floats each), a few queries per pass over the rows; outputs o [group, LINES * 16],
// log-sum-exps lse [group]. S holds group * n floats.
template <int LINES>
void decode_head(const float* qs, int64_t group, const float* K, const float* V, int64_t n, float* S, float* o,
                 float* lse) {
  constexpr int64_t D = LINES * 16;
  constexpr int QB = LINES > 4 ? 2 : 4;  // queries per pass: their accumulators and a row fit the registers
  float top[QB], total[QB];
  for (int64_t t = 0; t < group; t += QB) {
    const int64_t nq = group - t < QB ? group - t : QB;
    const float* qt = qs + t * D;
    float* St = S + t * n;
    switch (nq) {
      case 1: score_rows<LINES, 1>(qt, K, n, St, top); break;
      case 2: score_rows<LINES, 2>(qt, K, n, St, top); break;
      case 3: score_rows<LINES, 3>(qt, K, n, St, top); break;
      default: score_rows<LINES, QB>(qt, K, n, St, top); break;
    }
    // Weights exp(S - max), in place, and their sums.
    for (int64_t q = 0; q < nq; q++) {
      float* Sq = St + q * n;
      const __m512 mx = _mm512_set1_ps(top[q]);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = 0; k < n; k += 16) {
        const __mmask16 m = lanes(n - k);
        const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, Sq + k), mx)));
        _mm512_mask_storeu_ps(Sq + k, m, e);
        sum = _mm512_add_ps(sum, e);
      }
      total[q] = lane_sum(sum);
      lse[t + q] = top[q] + logf(total[q]);
    }
    switch (nq) {
      case 1: weigh_rows<LINES, 1>(St, n, 1, V, n, total, o + t * D); break;
      case 2: weigh_rows<LINES, 2>(St, n, 1, V, n, total, o + t * D); break;
      case 3: weigh_rows<LINES, 3>(St, n, 1, V, n, total, o + t * D); break;
      default: weigh_rows<LINES, QB>(St, n, 1, V, n, total, o + t * D); break;
    }
  }
}

// RB key rows' scores against every query of a wide group: Qt [LINES * 16, QV * 16] holds the scaled queries
// transposed, so each key element is broadcast against 16 queries at a time and no sum runs across lanes. Row
// j + i's scores go to S[(j + i) * QV * 16 ...], and mx keeps each query's largest.
template <int LINES, int QV, int RB>
inline void score_block(const float* Qt, const float* K, int64_t j, float* S, __m512* mx) {
  constexpr int64_t D = LINES * 16, G = QV * 16, AHEAD_ROWS = 16;
  __m512 acc[RB][QV];
  for (int i = 0; i < RB; i++)
    for (int v = 0; v < QV; v++) acc[i][v] = _mm512_setzero_ps();
  for (int l = 0; l < RB * LINES; l++)
    _mm_prefetch(reinterpret_cast<const char*>(K + (j + AHEAD_ROWS) * D + l * 16), _MM_HINT_T0);
  for (int64_t d = 0; d < D; d++) {
    __m512 qv[QV];
    for (int v = 0; v < QV; v++) qv[v] = _mm512_load_ps(Qt + d * G + v * 16);
    for (int i = 0; i < RB; i++) {
      const __m512 k = _mm512_set1_ps(K[(j + i) * D + d]);
      for (int v = 0; v < QV; v++) acc[i][v] = _mm512_fmadd_ps(k, qv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < RB; i++)
    for (int v = 0; v < QV; v++) {
      _mm512_storeu_ps(S + (j + i) * G + v * 16, acc[i][v]);
      mx[v] = _mm512_max_ps(mx[v], acc[i][v]);
    }
}

// decode_head for `count` queries q [count, LINES * 16] (unscaled), at most QV * 16 of them (a shared-rows
// group's, as many as the registers hold): the scores of all of them in one pass over the keys (score_block, the
// columns past `count` zero), then the values read once for every four queries. Qt holds QV * 16 * LINES * 16
// floats (64-byte aligned), S n * QV * 16.
template <int LINES, int QV>
void decode_head_wide(const float* q, int64_t count, float scale, const float* K, const float* V, int64_t n,
                      float* Qt, float* S, float* o, float* lse) {
  constexpr int64_t D = LINES * 16, G = QV * 16;
  constexpr int RB = 8 / QV;  // rows per block: 8 accumulators
  for (int64_t g = 0; g < G; g++)
    for (int64_t d = 0; d < D; d++) Qt[d * G + g] = g < count ? q[g * D + d] * scale : 0.0f;
  __m512 mx[QV], sum[QV];
  for (int v = 0; v < QV; v++) mx[v] = _mm512_set1_ps(-__builtin_inff()), sum[v] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + RB <= n; j += RB) score_block<LINES, QV, RB>(Qt, K, j, S, mx);
  for (; j < n; j++) score_block<LINES, QV, 1>(Qt, K, j, S, mx);
  for (j = 0; j < n; j++)  // weights exp(S - max), in place, and their sums
    for (int v = 0; v < QV; v++) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(S + j * G + v * 16), mx[v]));
      _mm512_storeu_ps(S + j * G + v * 16, e);
      sum[v] = _mm512_add_ps(sum[v], e);
    }
  float top[G], total[G];
  for (int v = 0; v < QV; v++) _mm512_storeu_ps(top + v * 16, mx[v]), _mm512_storeu_ps(total + v * 16, sum[v]);
  for (int64_t g = 0; g < count; g++) lse[g] = top[g] + logf(total[g]);
  for (int64_t t = 0; t < count; t += 4) switch (count - t) {
      case 1: weigh_rows<LINES, 1>(S + t, 1, G, V, n, total + t, o + t * D); break;
      case 2: weigh_rows<LINES, 2>(S + t, 1, G, V, n, total + t, o + t * D); break;
      case 3: weigh_rows<LINES, 3>(S + t, 1, G, V, n, total + t, o + t * D); break;
      default: weigh_rows<LINES, 4>(S + t, 1, G, V, n, total + t, o + t * D); break;
    }
}

// `count` queries q [count, D] (unscaled, contiguous) of one key/value head over its n rows K, V: outputs o
// [count, D], log-sum-exps l [count]. More than 8 and at most 32 queries of 64 floats (a shared-rows group's)
// take their scores in one pass (decode_head_wide), others a few at a time (decode_head). qs holds
// max(count, 32) * D floats (64-byte aligned), S max(count, 32) * n.
void attend_head(const float* q, int64_t count, int64_t D, float scale, const float* K, const float* V, int64_t n,
                 float* qs, float* S, float* o, float* l) {
  if (D == 64 && count > 8 && count <= 32) {
    if (count <= 16) decode_head_wide<4, 1>(q, count, scale, K, V, n, qs, S, o, l);
    else decode_head_wide<4, 2>(q, count, scale, K, V, n, qs, S, o, l);
    return;
  }
  for (int64_t i = 0; i < count * D; i++) qs[i] = q[i] * scale;
  switch (D) {
    case 16: decode_head<1>(qs, count, K, V, n, S, o, l); break;
    case 32: decode_head<2>(qs, count, K, V, n, S, o, l); break;
    case 64: decode_head<4>(qs, count, K, V, n, S, o, l); break;
    default: decode_head<8>(qs, count, K, V, n, S, o, l); break;
  }
}

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
// and ldc apart; bias may be null. `then` (may be null) is what the caller reads next: its first
// PANELS_AHEAD * K * 32 floats are prefetched during the last panels, so the next kernel does not start on
// cold memory.
void tz_gemm(const float* A, int64_t M, int64_t K, int64_t lda, const float* packed, int64_t N, float* C,
             int64_t ldc, const float* bias, int accumulate, const float* then) {
  const int64_t panels = (N + NR - 1) / NR;
  const int64_t lat = M < MR ? (M + 15) / 16 * 16 : MR;  // At's row: no wider than the rows it holds
  float* At = scratch(K * lat);
  for (int64_t m0 = 0; m0 < M; m0 += MR) {
    const int64_t rows = M - m0 < MR ? M - m0 : MR;
    int64_t i0 = 0;
    for (; i0 + 16 <= rows; i0 += 16) transpose16(A + (m0 + i0) * lda, lda, K, At + i0, lat);
    // The rest, k outer: the writes run along At's rows and each row of A stays in L1 for 16 steps of k.
    for (int64_t k = 0; k < K; k++)
      for (int64_t i = i0; i < rows; i++) At[k * lat + i] = A[(m0 + i) * lda + k];
    const int nt = static_cast<int>((rows + MAX_TILE - 1) / MAX_TILE);
    for (int64_t p = 0; p < panels; p++) {
      const float* panel = packed + p * K * NR;
      // The panel PANELS_AHEAD on (past the last one: `then`), in one contiguous share per tile.
      const float* next = p + PANELS_AHEAD < panels ? panel + PANELS_AHEAD * K * NR
                          : m0 + MR >= M && then ? then + (p + PANELS_AHEAD - panels) * K * NR : nullptr;
      const int64_t n0 = p * NR, width = N - n0 < NR ? N - n0 : NR;
      const __mmask16 m0mask = lanes(width), m1mask = width > 16 ? lanes(width - 16) : 0;
      int64_t i = 0;
      for (int ti = 0; ti < nt; ti++) {
        const int64_t r = (rows - i) / (nt - ti);  // tiles of nearly equal height
        GEMM_TILES[r](At + i, lat, panel, K, C + (m0 + i) * ldc + n0, ldc, m0mask, m1mask, accumulate != 0,
                      bias ? bias + n0 : nullptr, next ? next + ti * ((K + nt - 1) / nt) * NR : nullptr, nt);
        i += r;
      }
    }
  }
}

// The screen of an output head W[n, k] (element at W[n * stride_n + k * stride_k]) for tz_head_argmax:
// int8 codes in panels [ceil(N/32), K, 32] (zero past N), scale[n] = max_k |W[n, k]| / 127, and slack[n]:
// times |x| (Euclidean), a bound on how far row n's screened logit lies from the float32 logit tz_gemm gives,
// bias aside. It adds |scale q_n - w_n| to 2 (gamma + u) (|w_n| + |scale q_n|), u = 2^-24 and gamma =
// (K + 1) u / (1 - (K + 1) u): the rounding of float32 sums of K + 1 terms in any order, and of the scaling.
void tz_pack_screen(const float* W, int64_t K, int64_t N, int64_t stride_n, int64_t stride_k, int8_t* codes,
                    float* scale, double* slack) {
  const int64_t panels = (N + NR - 1) / NR;
  const double u = 1.0 / 16777216.0, gamma = (K + 1) * u / (1 - (K + 1) * u);
  memset(codes, 0, static_cast<size_t>(panels * K * NR));
  for (int64_t n = 0; n < N; n++) {
    float largest = 0;
    for (int64_t k = 0; k < K; k++) largest = fmaxf(largest, fabsf(W[n * stride_n + k * stride_k]));
    const float step = largest > 0 ? largest / 127 : 1.0f;
    double norm = 0, coded = 0, residual = 0;
    for (int64_t k = 0; k < K; k++) {
      const float w = W[n * stride_n + k * stride_k];
      const float q = fminf(127.0f, fmaxf(-127.0f, nearbyintf(w / step)));
      codes[((n / NR) * K + k) * NR + n % NR] = static_cast<int8_t>(q);
      const double approx = static_cast<double>(step) * q;
      norm += static_cast<double>(w) * w;
      coded += approx * approx;
      residual += (approx - w) * (approx - w);
    }
    scale[n] = step;
    slack[n] = sqrt(residual) + 2 * (gamma + u) * (sqrt(norm) + sqrt(coded));
  }
}

// The index of the largest logit tz_gemm gives for one row x [K] and a packed head (N rows, bias may be null),
// the first one on a tie, from screened logits v_n that lie within b_n of the float32 ones, and the float32
// panels of the few rows they cannot rule out: only rows with v_n + b_n at least max_m (v_m - b_m) can hold the
// maximum. Their panels are recomputed by the same tile code as tz_gemm, so the answer is that of the full
// logits exactly. Two screens:
// - tz_head_argmax's (INT false): v_n = screen[n] (bias included), b_n = |x| slack[n] + bias_slack[n].
// - tz_head_pick's (INT true), codes times a row of int8 codes qx over `unit` (x~ = unit qx): v_n = unit scale[n]
//   acc[n] + bias[n], exact but for two double roundings, and |v_n - x.w_n - bias[n]| <= |x - x~| |w_n| + |x~|
//   |w_n - w~_n|, so b_n = (|x - x~| + gamma |x|) norm[n] + |x~| residual[n] + bias_slack[n], gamma covering
//   tz_gemm's rounding as in tz_pack_screen.
// bias_slack (2 gamma |bias|) may be null. Returns -1 when x or a logit is not finite, -2 when more than
// max_candidates rows remain.
extern "C++" {  // a template, in the middle of the C functions it serves
template <bool INT>
static int64_t pick(const float* x, int64_t K, const float* packed, int64_t N, const float* bias, const void* screen,
                    const float* scale, const int8_t* qx, float unit, const double* slack, const double* residual,
                    const double* bias_slack, int64_t max_candidates) {
  double squares = 0, off = 0, coded = 0;
  for (int64_t k = 0; k < K; k++) {
    squares += static_cast<double>(x[k]) * x[k];
    if (INT) {
      const double approx = static_cast<double>(unit) * qx[k];
      off += (x[k] - approx) * (x[k] - approx);
      coded += approx * approx;
    }
  }
  if (!(squares < __builtin_inf())) return -1;
  const double u = 1.0 / 16777216.0, gamma = (K + 1) * u / (1 - (K + 1) * u);
  const double a = INT ? sqrt(off) + gamma * sqrt(squares) : sqrt(squares), c = INT ? sqrt(coded) : 0.0;
  const float* floats = static_cast<const float*>(screen);
  const int32_t* acc = static_cast<const int32_t*>(screen);
  // upper[n] = v_n + b_n in double; 1e-9 of margin on b_n covers the double arithmetic here, 1e-30 the float32
  // underflow of tiny products. Eight rows a step: this runs over the whole vocabulary on every greedy token.
  double* upper = reinterpret_cast<double*>(scratch(2 * N + 16));
  const __m512d margin = _mm512_set1_pd(1 + 1e-9), tiny = _mm512_set1_pd(1e-30), a8 = _mm512_set1_pd(a),
                c8 = _mm512_set1_pd(c), unit8 = _mm512_set1_pd(unit);
  __m512d floor8 = _mm512_set1_pd(-__builtin_inf()), finite8 = _mm512_setzero_pd();
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    __m512d b = _mm512_mul_pd(_mm512_loadu_pd(slack + n), a8), v;
    if (INT) {
      b = _mm512_fmadd_pd(_mm512_loadu_pd(residual + n), c8, b);
      v = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + n))),
                        _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(scale + n)), unit8));
      if (bias) v = _mm512_add_pd(v, _mm512_cvtps_pd(_mm256_loadu_ps(bias + n)));
    } else {
      v = _mm512_cvtps_pd(_mm256_loadu_ps(floats + n));
    }
    if (bias_slack) b = _mm512_add_pd(b, _mm512_loadu_pd(bias_slack + n));
    b = _mm512_fmadd_pd(b, margin, tiny);
    _mm512_storeu_pd(upper + n, _mm512_add_pd(v, b));
    finite8 = _mm512_add_pd(finite8, _mm512_sub_pd(v, v));  // NaN once any value is not finite
    floor8 = _mm512_max_pd(floor8, _mm512_sub_pd(v, b));
  }
  double floor = _mm512_reduce_max_pd(floor8);
  bool finite = _mm512_reduce_add_pd(finite8) == 0;
  for (; n < N; n++) {
    const double b = (slack[n] * a + (INT ? residual[n] * c : 0.0) + (bias_slack ? bias_slack[n] : 0.0)) *
                     (1 + 1e-9) + 1e-30;
    const double v = INT ? static_cast<double>(unit) * scale[n] * acc[n] + (bias ? bias[n] : 0.0f) : floats[n];
    finite &= v - v == 0;
    floor = v - b > floor ? v - b : floor;
    upper[n] = v + b;
  }
  if (!finite) return -1;
  int64_t candidates[64];
  int64_t found = 0;
  if (max_candidates > 64) max_candidates = 64;
  const __m512d floors = _mm512_set1_pd(floor);
  for (n = 0; n < N; n += 8) {  // eight at a time: few pass
    const __mmask8 within = N - n >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << (N - n)) - 1);
    for (unsigned hits = _mm512_mask_cmp_pd_mask(within, _mm512_maskz_loadu_pd(within, upper + n), floors, _CMP_GE_OQ);
         hits; hits &= hits - 1) {
      if (found == max_candidates) return -2;
      candidates[found++] = n + __builtin_ctz(hits);
    }
  }
  float* At = scratch(K * 16);  // x laid out as tz_gemm lays out one row of A (bounds are no longer needed)
  for (int64_t k = 0; k < K; k++) At[k * 16] = x[k];
  float exact[NR];
  int64_t best = -1, panel = -1;
  float best_logit = 0;
  for (int64_t c = 0; c < found; c++) {  // ascending, so the first of equal logits wins
    const int64_t n = candidates[c];
    if (n / NR != panel) {
      panel = n / NR;
      const int64_t width = N - panel * NR < NR ? N - panel * NR : NR;
      GEMM_TILES[1](At, 16, packed + panel * K * NR, K, exact, NR, lanes(width), width > 16 ? lanes(width - 16) : 0, false,
                    bias ? bias + panel * NR : nullptr, nullptr, 1);
    }
    const float logit = exact[n % NR];
    if (!(logit - logit == 0)) return -1;
    if (best < 0 || logit > best_logit) best = n, best_logit = logit;
  }
  return best;
}
}  // extern "C++"

// tz_head_argmax for M rows of x (x_st floats apart), each its own index in out[M]: the int8 screen of every
// head row is read once for all of them, SCREEN_ROWS rows of x at a time. `screen` is scratch for M * N floats.
void tz_head_argmax(const float* x, int64_t M, int64_t x_st, int64_t K, const float* packed, const int8_t* codes,
                    int64_t N, const float* scale, const float* bias, const double* slack, const double* bias_slack,
                    float* screen, int64_t max_candidates, int64_t* out) {
  const int64_t panels = (N + NR - 1) / NR;
  for (int64_t p = 0; p < panels; p++)
    for (int64_t r = 0; r < M; r += SCREEN_ROWS)
      SCREENS[M - r < SCREEN_ROWS ? M - r : SCREEN_ROWS](
          x + r * x_st, x_st, K, codes + p * K * NR, scale + p * NR, bias ? bias + p * NR : nullptr,
          N - p * NR < NR ? N - p * NR : NR, screen + r * N + p * NR, N,
          r == 0 && p + SCREEN_AHEAD < panels ? codes + (p + SCREEN_AHEAD) * K * NR : nullptr);
  for (int64_t r = 0; r < M; r++)
    out[r] = pick<false>(x + r * x_st, K, packed, N, bias, screen + r * N, nullptr, nullptr, 0, slack, nullptr,
                         bias_slack, max_candidates);
}

// tz_head_argmax for M rows of x from an int8 screen computed elsewhere (a library's int8 matrix product):
// acc[r, n] = sum_k qx[r, k] codes[n, k] exactly, x~_r = unit[r] qx[r] and w~_n = scale[n] codes[n]; norm[n] =
// |w_n| and residual[n] = |w_n - w~_n|, in double (see pick).
void tz_head_pick(const float* x, int64_t M, int64_t x_st, int64_t K, const float* packed, int64_t N,
                  const float* bias, const int32_t* acc, const int8_t* qx, const float* unit, const float* scale,
                  const double* norm, const double* residual, const double* bias_slack, int64_t max_candidates,
                  int64_t* out) {
  for (int64_t r = 0; r < M; r++)
    out[r] = pick<true>(x + r * x_st, K, packed, N, bias, acc + r * N, scale, qx + r * K, unit[r], norm, residual,
                        bias_slack, max_candidates);
}

// Causal attention of T queries at positions start..start+T-1 over keys 0..L-1 (L = start + T), for H
// query heads sharing Hkv key/value heads (grouped-query attention), head dim D (32, 64 or 128).
// q[t, h, d] at q + t * q_st + h * D + d; out[t, h, d] at out + t * o_st + h * D + d. The keys and values
// come in `segments` pieces that follow each other in position order (a stored prefix need not be copied
// next to the new tokens first): piece s holds seg_len[s] rows [Hkv, seg_len[s], D], key head g of
// piece s at seg_keys[s] + g * seg_head_stride[s], rows D floats apart. T at most 64; returns -1 for a
// shape it does not take. `then` (may be null) is what the caller reads next: it starts streaming in
// during the last blocks.
//
// One pass per head with an online softmax over blocks of BLOCK keys (running maximum and sum per query,
// the output rescaled when the maximum grows): each block's keys and values are read once, while the block
// AHEAD places later streams in, so memory and arithmetic overlap instead of alternating.
int tz_attention(const float* q, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t q_st, int segments,
                 const float* const* seg_keys, const float* const* seg_values, const int64_t* seg_head_stride,
                 const int64_t* seg_len, int64_t start, float scale, float* out, int64_t o_st, const float* then) {
  if ((D != 32 && D != 64 && D != 128) || T < 1 || T > 64 || segments < 1 || H % Hkv != 0) return -1;
  int64_t L = 0;
  for (int s = 0; s < segments; s++) L += seg_len[s];
  if (L != start + T) return -1;
  FlushDenormals flush;
  const int TV = static_cast<int>((T + 15) / 16);
  const int64_t TP = TV * 16, lines = D / 16;
  const int64_t group = H / Hkv;
  // Every block in the order it is computed, then `then` as blocks of raw lines to prefetch.
  const int64_t per_head = (L + BLOCK - 1) / BLOCK + segments;
  // One scratch buffer: the block list, then qT [D, TP], a block's scores [BLOCK, TP], per-query state.
  const int64_t list_floats = (((H * per_head + AHEAD) * static_cast<int64_t>(sizeof(Block)) + 63) / 64) * 16;
  float* memory = scratch(list_floats + D * TP + BLOCK * TP + 3 * 64);
  Block* blocks = reinterpret_cast<Block*>(memory);
  int64_t count = 0;
  for (int64_t h = 0; h < H; h++)
    for (int64_t s = 0, base = 0; s < segments; base += seg_len[s], s++) {
      const float* keys = seg_keys[s] + (h / group) * seg_head_stride[s];
      const float* values = seg_values[s] + (h / group) * seg_head_stride[s];
      for (int64_t j = 0; j < seg_len[s]; j += BLOCK)
        blocks[count++] = {keys + j * D, values + j * D, seg_len[s] - j < BLOCK ? seg_len[s] - j : BLOCK, base + j};
    }
  const int64_t computed = count;
  for (int64_t a = 0; a < AHEAD; a++)  // `then` in pieces the size of a block's keys and values
    blocks[count++] = {then ? then + 2 * a * BLOCK * D : nullptr, then ? then + (2 * a + 1) * BLOCK * D : nullptr,
                       then ? BLOCK : 0, 0};
  float* qT = memory + list_floats;
  float* S = qT + D * TP;
  float* alpha = S + BLOCK * TP;
  float* total = alpha + 64;
  float* running = total + 64;
  const int rows = SCORE_ROWS[TV];
  int64_t b = 0;
  for (int64_t h = 0; h < H; h++) {
    for (int64_t d = 0; d < D; d++)
      for (int64_t t = 0; t < TP; t++) qT[d * TP + t] = t < T ? q[t * q_st + h * D + d] * scale : 0.0f;
    for (int v = 0; v < TV; v++) {
      _mm512_store_ps(running + v * 16, _mm512_set1_ps(-__builtin_inff()));
      _mm512_store_ps(total + v * 16, _mm512_setzero_ps());
    }
    float* o = out + h * D;
    for (bool first = true; b < computed && (first || blocks[b].position != 0); b++, first = false) {
      const Block& block = blocks[b];
      const Block& ahead = blocks[b + AHEAD < count ? b + AHEAD : count - 1];
      const int64_t n = block.rows, pf_lines = b + AHEAD < count ? ahead.rows * lines : 0;
      // Scores; keys past `start` are seen only by the queries at or after them.
      __m512 mx[4];
      for (int v = 0; v < TV; v++) mx[v] = _mm512_set1_ps(-__builtin_inff());
      // Keys past `start` are seen only by the queries at or after them: such a block's maximum is taken
      // after the masking.
      const bool masked = block.position + n - 1 > start;
      __m512 unused[4] = {};
      __m512* tile_max = masked ? unused : mx;
      int64_t j = 0, prefetched = 0;
      for (; j + rows <= n; j += rows, prefetched += D)
        SCORE_FULL[TV](qT, D, block.keys + j * D, S + j * TP, tile_max, ahead.keys + prefetched * 16,
                       pf_lines - prefetched);
      for (; j + 4 <= n; j += 4) SCORE_FOUR[TV](qT, D, block.keys + j * D, S + j * TP, tile_max, nullptr, 0);
      for (; j < n; j++) SCORE_ONE[TV](qT, D, block.keys + j * D, S + j * TP, tile_max, nullptr, 0);
      if (masked) {
        for (int64_t k = start + 1 - block.position > 0 ? start + 1 - block.position : 0; k < n; k++) {
          const int64_t hidden = block.position + k - start;  // queries t < hidden do not see this key
          for (int64_t t = 0; t < hidden && t < TP; t++) S[k * TP + t] = -__builtin_inff();
        }
        for (int64_t k = 0; k < n; k++)
          for (int v = 0; v < TV; v++) mx[v] = _mm512_max_ps(mx[v], _mm512_load_ps(S + k * TP + v * 16));
      }
      for (; prefetched < pf_lines; prefetched++)
        _mm_prefetch(reinterpret_cast<const char*>(ahead.keys + prefetched * 16), _MM_HINT_T1);
      // Online softmax: scale the sums so far by exp(old max - new max), weights relative to the new max.
      for (int v = 0; v < TV; v++) {
        const __m512 old = _mm512_load_ps(running + v * 16), top = _mm512_max_ps(old, mx[v]);
        const __m512 shrink = exp_nonpositive(_mm512_sub_ps(old, top));
        __m512 sum = _mm512_mul_ps(_mm512_load_ps(total + v * 16), shrink);
        for (int64_t k = 0; k < n; k++) {
          const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(S + k * TP + v * 16), top));
          _mm512_store_ps(S + k * TP + v * 16, e);
          sum = _mm512_add_ps(sum, e);
        }
        _mm512_store_ps(running + v * 16, top);
        _mm512_store_ps(total + v * 16, sum);
        _mm512_store_ps(alpha + v * 16, shrink);
      }
      const float* vpf = ahead.values;
      if (D == 64) block_values<4>(S, TP, T, n, block.values, o, o_st, alpha, first, vpf, pf_lines);
      else if (D == 128) block_values<8>(S, TP, T, n, block.values, o, o_st, alpha, first, vpf, pf_lines);
      else block_values<2>(S, TP, T, n, block.values, o, o_st, alpha, first, vpf, pf_lines);
    }
    for (int64_t t = 0; t < T; t++) {
      const __m512 inv = _mm512_set1_ps(1.0f / total[t]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(o + t * o_st + d, _mm512_mul_ps(_mm512_loadu_ps(o + t * o_st + d), inv));
    }
  }
  return 0;
}

// One query per row over that row's own keys and values: the attention of a decode step of many sequences,
// each over its own history. Row r: q + r * q_st holds H heads of D floats; keys[r] and values[r] hold Hkv heads,
// head_stride[r] floats apart, of lengths[r] rows of D floats. out + r * o_st gets the heads' outputs [H, D];
// lse + r * H each head's log-sum-exp of its scaled scores (to merge with attention over other keys). Query
// heads of one key/value head read its rows together: one pass over the keys for the scores, one over the values
// for the sums, each streaming rows ahead. Rows may form groups whose histories begin with the same rows (the
// same values in every member's buffers): row r is in group[r] (or none, -1), and group i's first shared[i] rows,
// read from the buffers of its row holder[i], are attended once for the queries of all its members, chunks of at
// most max(32, H / Hkv) queries at a time; each member's own rest (its rows from shared[i] on, at least one) is
// attended alone, and the two merged by their log-sum-exps (lse the merged one). `work` holds work_floats floats,
// 64-byte aligned, left to the caller to zero: at least max(32, H / Hkv) * (3 D + 4 + max(lengths)). D is 16,
// 32, 64 or 128. Returns -1, having written nothing, for a shape or grouping it does not take.
int tz_decode_attention(int64_t R, int64_t H, int64_t Hkv, int64_t D, const float* q, int64_t q_st,
                        const float* const* keys, const float* const* values, const int64_t* head_stride,
                        const int64_t* lengths, const int64_t* group, int64_t groups, const int64_t* holder,
                        const int64_t* shared, float scale, float* out, int64_t o_st, float* lse, float* work,
                        int64_t work_floats) {
  if ((D != 16 && D != 32 && D != 64 && D != 128) || Hkv < 1 || H % Hkv != 0) return -1;
  const int64_t per_kv = H / Hkv;
  const int64_t chunk = (per_kv > 32 ? per_kv : 32) / per_kv * per_kv;  // whole members' queries
  int64_t longest = 0;
  for (int64_t r = 0; r < R; r++) {
    if (lengths[r] < 1 || group[r] < -1 || group[r] >= groups) return -1;
    if (group[r] >= 0 && (shared[group[r]] < 1 || shared[group[r]] >= lengths[r])) return -1;
    longest = lengths[r] > longest ? lengths[r] : longest;
  }
  for (int64_t i = 0; i < groups; i++)
    if (holder[i] < 0 || holder[i] >= R || group[holder[i]] != i) return -1;
  const int64_t width = per_kv > 32 ? per_kv : 32;  // at least a chunk, and what attend_head pads one to
  if (work_floats < width * (3 * D + 4 + longest)) return -1;
  FlushDenormals flush;
  float* qs = work;  // scaled queries, 64-byte aligned; then the chunk's queries gathered, its shared outputs,
  float* gathered = qs + width * D;  // the scores, its shared log-sum-exps and a member's own
  float* shared_out = gathered + width * D;
  float* S = shared_out + width * D;
  float* shared_lse = S + width * longest;
  float* own_lse = shared_lse + width;
  for (int64_t r = 0; r < R; r++)  // rows alone
    if (group[r] < 0)
      for (int64_t g = 0; g < Hkv; g++)
        attend_head(q + r * q_st + g * per_kv * D, per_kv, D, scale, keys[r] + g * head_stride[r],
                    values[r] + g * head_stride[r], lengths[r], qs, S, out + r * o_st + g * per_kv * D,
                    lse + r * H + g * per_kv);
  int64_t* members = reinterpret_cast<int64_t*>(own_lse + width);  // chunk / per_kv of them
  for (int64_t i = 0; i < groups; i++) {
    const int64_t h = holder[i], n = shared[i];
    for (int64_t g = 0; g < Hkv; g++) {
      for (int64_t first = 0; first < R;) {  // the group's members, a chunk of their queries at a time
        int64_t count = 0;
        for (; first < R && count < chunk; first++)
          if (group[first] == i) members[count / per_kv] = first, count += per_kv;
        if (count == 0) break;
        for (int64_t m = 0; m < count / per_kv; m++)
          memcpy(gathered + m * per_kv * D, q + members[m] * q_st + g * per_kv * D, per_kv * D * 4);
        attend_head(gathered, count, D, scale, keys[h] + g * head_stride[h], values[h] + g * head_stride[h], n, qs,
                    S, shared_out, shared_lse);
        for (int64_t m = 0; m < count / per_kv; m++) {
          const int64_t r = members[m];
          float* o = out + r * o_st + g * per_kv * D;
          attend_head(gathered + m * per_kv * D, per_kv, D, scale, keys[r] + g * head_stride[r] + n * D,
                      values[r] + g * head_stride[r] + n * D, lengths[r] - n, qs, S, o, own_lse);
          for (int64_t p = 0; p < per_kv; p++) {  // merged by their log-sum-exps
            const float a = shared_lse[m * per_kv + p], b = own_lse[p], top = a > b ? a : b;
            const float wa = expf(a - top), wb = expf(b - top), inv = 1.0f / (wa + wb);
            const float* so = shared_out + (m * per_kv + p) * D;
            for (int64_t d = 0; d < D; d++) o[p * D + d] = (so[d] * wa + o[p * D + d] * wb) * inv;
            lse[r * H + g * per_kv + p] = top + logf(wa + wb);
          }
        }
      }
    }
  }
  return 0;
}

// A decode step's new key and value rows, one per sequence, written into each sequence's own buffers: row r's
// Hkv heads (head g at src_k + r * src_st + g * src_head_st, D floats; the same for src_v) go to row positions[r]
// of keys[r] and values[r], whose heads lie head_stride[r] floats apart.
void tz_append_rows(int64_t R, int64_t Hkv, int64_t D, const float* src_k, const float* src_v, int64_t src_st,
                    int64_t src_head_st, float* const* keys, float* const* values, const int64_t* head_stride,
                    const int64_t* positions) {
  for (int64_t r = 0; r < R; r++)
    for (int64_t g = 0; g < Hkv; g++) {
      const int64_t at = g * head_stride[r] + positions[r] * D;
      memcpy(keys[r] + at, src_k + r * src_st + g * src_head_st, D * 4);
      memcpy(values[r] + at, src_v + r * src_st + g * src_head_st, D * 4);
    }
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
    const float mean = lane_sum(acc) / static_cast<float>(N);
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

// ---- The whole forward of a short chunk: every decoder layer of a Llama-shaped model in one call ----

extern "C" {

// A linear layer packed by tz_pack: y = x W^T + bias.
struct TzLinear {
  const float* packed;
  int64_t in_features, out_features;
  const float* bias;  // may be null
};

struct TzLayer {
  const float* input_norm;
  const float* post_norm;
  TzLinear qkv;  // q, k and v projections stacked: [(heads + 2 kv_heads) head_dim, hidden]
  TzLinear output, gate_up, down;  // gate_up: gate and up stacked, [2 intermediate, hidden]
  // Where this chunk's keys and values go: key head g, token t at new_keys + g * new_head_stride + t * head_dim.
  float* new_keys;
  float* new_values;
  int64_t new_head_stride;
  // The layer's keys and values over [0, start + T) in pieces, as tz_attention takes them (the chunk's own rows
  // included: they are written before attention reads them).
  int segments;
  const float* const* seg_keys;
  const float* const* seg_values;
  const int64_t* seg_head_stride;
  const int64_t* seg_len;
};

struct TzModel {
  const float* embedding;  // [vocab, hidden], rows contiguous
  int64_t hidden, intermediate, heads, kv_heads, head_dim;
  float eps, scale;
  const float* final_norm;
  float final_eps;
  const float* after;  // what the caller reads after the last layer (the output head), prefetched; may be null
};

// Runs tokens ids[0, T) at positions start.. through every layer. cos and sin [T, head_dim] are the rotary tables
// of the positions. work holds T * (2 hidden + (heads + 2 kv_heads) head_dim + heads head_dim + 3 intermediate)
// floats. The last layer runs attention and
// MLP for the last token only (only it reaches the logits), and not at all unless `logits`; then the last
// token's final normed hidden state goes to last [hidden]. `ready`, unless null, is called with a layer's index
// before the layer writes its new rows or reads its stored ones (which may still be arriving: a sealed hit's rows
// open while the layers before compute). Returns 0, or -1 for a shape the kernels do not take.
int tz_decoder_forward(const TzModel* model, const TzLayer* layers, int64_t n_layers, const int64_t* ids, int64_t T,
                       int64_t start, const float* cos, const float* sin, float* work, int logits, float* last,
                       void (*ready)(int64_t)) {
  const int64_t H = model->hidden, I = model->intermediate, D = model->head_dim;
  const int64_t q_width = model->heads * D, kv_width = model->kv_heads * D, qkv_width = q_width + 2 * kv_width;
  float* hidden = work;
  for (int64_t t = 0; t < T; t++) memcpy(hidden + t * H, model->embedding + ids[t] * H, H * 4);
  float* normed = hidden + T * H;
  float* qkv = normed + T * H;
  float* attended = qkv + T * qkv_width;
  float* gate_up = attended + T * q_width;
  float* activated = gate_up + 2 * T * I;
  for (int64_t index = 0; index < n_layers; index++) {
    const TzLayer& layer = layers[index];
    const bool final = index + 1 == n_layers;
    const float* following = final ? model->after : layers[index + 1].qkv.packed;
    tz_rmsnorm(hidden, T, H, H, layer.input_norm, model->eps, normed, H);
    if (!final) {
      tz_gemm(normed, T, H, H, layer.qkv.packed, qkv_width, qkv, qkv_width, layer.qkv.bias, 0, nullptr);
    } else {  // keys and values of every token, the query of the last one only (and none without logits)
      const float* kv_bias = layer.qkv.bias ? layer.qkv.bias + q_width : nullptr;
      tz_gemm(normed, T, H, H, layer.qkv.packed + q_width * H, 2 * kv_width, qkv + q_width, qkv_width, kv_bias, 0,
              logits ? layer.qkv.packed : nullptr);
      if (logits)
        tz_gemm(normed + (T - 1) * H, 1, H, H, layer.qkv.packed, q_width, qkv + (T - 1) * qkv_width, qkv_width,
                layer.qkv.bias, 0, nullptr);
    }
    if (!final) {
      tz_rope(qkv, T, model->heads + model->kv_heads, D, qkv_width, cos, sin);
    } else {
      tz_rope(qkv + q_width, T, model->kv_heads, D, qkv_width, cos, sin);
      if (logits) tz_rope(qkv + (T - 1) * qkv_width, 1, model->heads, D, qkv_width, cos + (T - 1) * D, sin + (T - 1) * D);
    }
    if (ready) ready(index);  // before the new rows are written: rows still opening may reach past the stored ones
    for (int64_t g = 0; g < model->kv_heads; g++)
      for (int64_t t = 0; t < T; t++) {
        memcpy(layer.new_keys + g * layer.new_head_stride + t * D, qkv + t * qkv_width + q_width + g * D, D * 4);
        memcpy(layer.new_values + g * layer.new_head_stride + t * D, qkv + t * qkv_width + q_width + kv_width + g * D,
               D * 4);
      }
    if (final && !logits) return 0;
    // In the last layer only the last token goes on.
    const int64_t rows = final ? 1 : T, first = T - rows;
    float* x = hidden + first * H;
    if (tz_attention(qkv + first * qkv_width, rows, model->heads, model->kv_heads, D, qkv_width, layer.segments,
                     layer.seg_keys, layer.seg_values, layer.seg_head_stride, layer.seg_len, start + first,
                     model->scale, attended, q_width, layer.output.packed) != 0)
      return -1;
    tz_gemm(attended, rows, q_width, q_width, layer.output.packed, H, x, H, layer.output.bias, 1, layer.gate_up.packed);
    tz_rmsnorm(x, rows, H, H, layer.post_norm, model->eps, normed, H);
    tz_gemm(normed, rows, H, H, layer.gate_up.packed, 2 * I, gate_up, 2 * I, layer.gate_up.bias, 0, layer.down.packed);
    tz_silu_mul(gate_up, rows, I, activated);
    tz_gemm(activated, rows, I, I, layer.down.packed, H, x, H, layer.down.bias, 1, following);
  }
  tz_rmsnorm(hidden + (T - 1) * H, 1, H, H, model->final_norm, model->final_eps, last, H);
  return 0;
}

}  // extern "C"
