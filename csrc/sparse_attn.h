/*
 * sparse_attn — the whole C API.
 *
 * Every entry point returns an int status (SA_OK == 0); sa_strerror() turns a
 * status into the text the Python layer raises with.  Nothing here keeps
 * scratch state between calls: the functions are reentrant and run with the
 * GIL released.
 *
 * Layouts (docs/spec.md §1):
 *   q (decode)   float32 [n_heads, head_dim]
 *   q (prefill)  float32 [n_heads, T, head_dim]
 *   K, V         sa_kv: [n_kv_heads, head_stride rows, head_dim], rows contiguous;
 *                head_stride >= the number of readable rows (the rest is capacity)
 *   importance   float32 [>= seq_len]
 *
 * Sizes are C ints (at most 2^31 - 1 rows, heads, channels); every row,
 * element and byte offset computed from them is 64-bit, so any size that
 * fits is served.  Values: the entry points scan the arrays they are given
 * once per call (q, importance, the rows appended to a cache, the input of
 * sa_quantize_q8) and refuse NaN, Inf and magnitudes of SA_VALUE_LIMIT or
 * more before computing anything: below that limit no score, softmax
 * weight or weighted sum can overflow float32 for any head_dim.  K and V
 * given directly are not scanned (that would cost a read of the whole KV
 * per call); a NaN in them makes the output of the heads that read it NaN,
 * on every ISA.
 *
 * The block between the cdef markers is what build_ffi.py hands to cffi, so it
 * must stay plain declarations (no includes, no expressions in #defines).
 */
#ifndef SPARSE_ATTN_H
#define SPARSE_ATTN_H

#include <stddef.h>
#include <stdint.h>

/* cdef-begin */
/* Decode attends to a group's rows in chunks of at most this many rows,
 * merged in a fixed order (spec §2.6): a group attending to more rows is
 * split over threads too, and its output is dense decode's within float
 * rounding of one pass, bitwise the same for every thread count. */
#define SA_DECODE_CHUNK_ROWS 2048

enum sa_status {
    SA_OK = 0,
    SA_ERR_NULL = 1,          /* a required pointer is NULL */
    SA_ERR_SHAPE = 2,         /* a dimension is < 1 or inconsistent */
    SA_ERR_DTYPE = 3,         /* unknown KV dtype or K/V dtype mismatch */
    SA_ERR_SEQ_LEN = 4,       /* seq_len < 1 or beyond the KV's rows */
    SA_ERR_PARAM = 5,         /* a selection parameter out of range */
    SA_ERR_GROUP = 6,         /* q8 group size does not divide head_dim */
    SA_ERR_GQA = 7,           /* n_heads is not a multiple of n_kv_heads */
    SA_ERR_NOMEM = 8,         /* scratch allocation failed */
    SA_ERR_THREAD = 9,        /* a worker thread could not be started */
    SA_ERR_ISA = 10,          /* unknown ISA name, or one this CPU cannot run */
    SA_ERR_VALUES = 11,       /* the input of sa_quantize_q8 holds NaN, Inf or
                                 magnitudes >= SA_VALUE_LIMIT */
    SA_ERR_IMPORTANCE = 12,   /* importance shorter than seq_len */
    SA_ERR_SCALE = 13,        /* scale not finite or not > 0 */
    SA_ERR_BOUNDS = 14,       /* minmax bounds missing, or not made for this K,
                                 seq_len and block_size */
    SA_ERR_PROBE_ROWS = 15,   /* probe rows not made for this K, seq_len,
                                 block_size and n_probe */
    SA_ERR_IMPORTANCE_VALUES = 16, /* importance[0, seq_len) holds NaN or Inf */
    SA_ERR_Q_VALUES = 17,     /* q holds NaN, Inf or magnitudes >= SA_VALUE_LIMIT */
    SA_ERR_K_VALUES = 18,     /* the K rows appended hold NaN, Inf or magnitudes
                                 >= SA_VALUE_LIMIT */
    SA_ERR_V_VALUES = 19,     /* the V rows appended likewise */
    SA_ERR_SIZE = 20,         /* sizes whose scratch would not fit size_t */
    SA_ERR_CHANNELS = 21,     /* channel copy missing, or not made for this K,
                                 seq_len and block_size */
    SA_ERR_UNSUPPORTED = 22,  /* sa_ggml_flash_attn: an attention feature it does
                                 not compute (ALiBi, logit softcap, sinks,
                                 n_kv_max, K and V head sizes that differ) */
    SA_ERR_LAYOUT = 23        /* sa_ggml_flash_attn: a row that is not contiguous,
                                 a negative or misaligned stride or address, or
                                 an output that is not contiguous */
};

/* SA_VALUE_LIMIT = 2^48: |q|, |k| < 2^48 keep any dot over < 2^31 channels
 * below 2^127, and |v| < 2^48 any weighted sum of < 2^31 rows. */
#define SA_VALUE_LIMIT_LOG2 48

enum sa_dtype { SA_DTYPE_F32 = 0, SA_DTYPE_Q8 = 1 };
enum sa_share { SA_SHARE_HEAD = 0, SA_SHARE_GROUP = 1 };
enum sa_scoring { SA_SCORING_PROBE = 0, SA_SCORING_MINMAX = 1, SA_SCORING_CHANNELS = 2 };

/* A K or V tensor.  For SA_DTYPE_F32 `f32` is used; for SA_DTYPE_Q8 `q8` and
 * `scales` ([n_kv_heads, head_stride, head_dim / group_size]) are. */
typedef struct sa_kv {
    int dtype;
    int n_kv_heads;
    int head_stride;          /* rows between the starts of two KV heads */
    int n_rows;               /* rows that may be read per head (<= head_stride) */
    int head_dim;
    int group_size;           /* q8 only: channels sharing one scale */
    const float *f32;
    const int8_t *q8;
    const float *scales;
} sa_kv;

/* Per-block, per-channel key bounds for scoring="minmax" (spec §6, Quest):
 * for block b of KV head kh and channel i, mn/mx hold int8 values that,
 * times the scale of the channel's scale group, bound K[kh, t, i] from
 * below/above over the block's valid rows (rounded outwards, so the bound
 * stays a true bound).
 *   mn, mx  int8  [n_kv_heads, head_stride, head_dim]
 *   scales  float [n_kv_heads, head_stride, head_dim / scale_group]
 * head_stride is in blocks; k_rows is the number of K rows the bounds were
 * computed over (the last block may be partial). */
typedef struct sa_bounds {
    int n_kv_heads;
    int head_dim;
    int block_size;
    int scale_group;          /* channels sharing one bound scale */
    int head_stride;
    int k_rows;
    int8_t *mn;
    int8_t *mx;
    float *scales;
} sa_bounds;

/* The probe's sampled K rows (spec §2.2), copied out of K block by block so
 * that the probe reads them front to back instead of picking every step-th
 * row out of K (which the hardware prefetchers turn into a read of all of
 * K).  For block_size BS and n_probe P, step = max(1, BS / P) and each full
 * block b keeps cnt = ceil(BS / step) rows: K rows b*BS + j*step, j < cnt,
 * at copy rows b*cnt + j.  The last, partial block of a context is probed
 * from K itself (its step differs).  `rows` is a tensor of K's dtype, row
 * layout and q8 group whose n_rows is the copy rows allocated per head;
 * k_rows is the number of K rows the copies are current for (rows of K
 * beyond it may have changed). */
typedef struct sa_probe_rows {
    sa_kv rows;
    int block_size;
    int n_probe;
    int k_rows;
} sa_probe_rows;

/* The channel-major copy of K for scoring="channels" (spec §6, after
 * SparQ): for KV head kh, block b and channel i, the block's values of that
 * channel, K[kh, b*bs + t, i] for the block's valid rows t (dequantised
 * for q8), quantised as one q8 group (the rows a partial block lacks count
 * as zeros; their bytes are never read or written):
 *   q8      int8  [n_kv_heads, head_dim, head_stride, block_rows]
 *   scales  float [n_kv_heads, head_dim, head_stride]
 * so that a score over a few channels reads those channels' bytes only,
 * each channel front to back.  head_stride is the blocks a channel's row
 * holds (at least the context's); block_rows, the values kept per block and
 * channel, is block_size or, for a copy of fewer rows than a block, at
 * least those rows; k_rows is the number of K rows the copy was made from
 * (the last block may be partial). */
typedef struct sa_channels {
    int n_kv_heads;
    int head_dim;
    int block_size;
    int block_rows;
    int head_stride;
    int k_rows;
    int8_t *q8;
    float *scales;
} sa_channels;

/* Block selection (spec §2 and §6).  The seed's rule is block_size 32,
 * k_blocks 32, n_probe 8, recency 1, importance_blocks (k_blocks+1)/2,
 * sink_blocks 0, share SA_SHARE_HEAD. */
typedef struct sa_select_params {
    int block_size;
    int k_blocks;
    int n_probe;
    int recency;              /* 0 or 1 */
    int importance_blocks;    /* size of the importance reserve in blocks, used
                                 only when importance is given */
    int sink_blocks;          /* leading blocks always chosen */
    int share;                /* enum sa_share */
    int scoring;              /* enum sa_scoring */
    const sa_bounds *bounds;  /* scoring == SA_SCORING_MINMAX: bounds of K over
                                 exactly seq_len rows, same block_size */
    const sa_probe_rows *probe_rows; /* scoring == SA_SCORING_PROBE, optional:
                                 copies of the probe's rows, current for at
                                 least seq_len rows, same block_size and
                                 n_probe; the scores are bitwise those read
                                 from K.  NULL probes K directly. */
    int n_channels;           /* scoring == SA_SCORING_CHANNELS: channels scored
                                 (min(n_channels, head_dim) of them) */
    const sa_channels *channels; /* scoring == SA_SCORING_CHANNELS: the copy of
                                 K over exactly seq_len rows, same block_size */
    int exact_tail;           /* >= 0 (every call checks it); read by sa_prefill
                                 only: the blocks holding the call's last
                                 exact_tail query rows attend exactly (spec §7.6) */
} sa_select_params;

const char *sa_strerror(int status);

/* How this core was built: compiler, flags, target architecture. */
const char *sa_build_info(void);

/* ISA dispatch.  sa_isa_name() names the kernels in use; sa_set_isa() picks a
 * path by name ("portable", "avx2", "avx512-vnni", "neon", "neon-dotprod");
 * sa_isa_available() says whether this CPU can run it (1) or not (0). */
const char *sa_isa_name(void);
int sa_set_isa(const char *name);

/* The worker pool's placement: workers 1 .. n_cpus - 1 (with the calling
 * thread, the first n_cpus threads of a call) run on the CPUs listed; any
 * later worker on any CPU the process may use.  n_cpus = 0 lifts it.  The
 * Python layer sets the fast cores of a big.LITTLE CPU (sparse_attn/cores.py).
 * SA_ERR_PARAM for a CPU number below 0 or beyond the system's CPU set, or
 * n_cpus beyond 64; does nothing where threads cannot be placed (not
 * Linux).  Never changes a result, only where it is computed. */
int sa_set_worker_cpus(const int *cpus, int n_cpus);
int sa_isa_available(const char *name);
int sa_isa_count(void);
const char *sa_isa_name_at(int index);

/* Spec §4: quantise n_rows rows of dim floats, group by group.  Refuses
 * (SA_ERR_VALUES) input with NaN, Inf or magnitudes >= SA_VALUE_LIMIT. */
int sa_quantize_q8(const float *x, int64_t n_rows, int dim, int group_size,
                   int8_t *q, float *scales);

/* probe[h * n_blocks + b] = max over sampled positions of dot(q_h, K[kh, pos]). */
int sa_probe_scores(const float *q, int n_heads, const sa_kv *k, int seq_len,
                    int block_size, int n_probe, float *probe, int threads);

/* blocks[h * n_sel + i], ascending per head, n_sel = min(k_blocks, n_blocks).
 * importance may be NULL (n_importance is then ignored). */
int sa_select_blocks(const float *q, int n_heads, const sa_kv *k, int seq_len,
                     const sa_select_params *params, const float *importance,
                     int64_t n_importance, int32_t *blocks, int threads);

/* out [n_heads, head_dim]; blocks may be NULL. */
int sa_sparse_decode(const float *q, int n_heads, const sa_kv *k, const sa_kv *v,
                     int seq_len, const sa_select_params *params,
                     const float *importance, int64_t n_importance, float scale,
                     float *out, int32_t *blocks, int threads);

int sa_dense_decode(const float *q, int n_heads, const sa_kv *k, const sa_kv *v,
                    int seq_len, float scale, float *out, int threads);

/* One decode call of a batch (sa_decode_batch): sa_sparse_decode's
 * arguments, or sa_dense_decode's when params is NULL (importance and
 * blocks are then ignored). */
typedef struct sa_decode_call {
    const float *q;
    int n_heads;
    const sa_kv *k, *v;
    int seq_len;
    const sa_select_params *params;
    const float *importance;
    int64_t n_importance;
    float scale;
    float *out;
    int32_t *blocks;
} sa_decode_call;

/* n_calls decode calls (one per sequence of a batch, each with its own
 * K/V) as one parallel job: their work items (per KV head, or per KV head
 * and chunk) split over the threads together.  Each call's output and
 * blocks are bitwise what it gives alone.  Every call is checked before
 * any runs; on an error *failed (may be NULL) is the index of the call it
 * is about (-1 for none) and no output is written. */
int sa_decode_batch(const sa_decode_call *calls, int n_calls, int threads, int *failed);

/* q [n_heads, T, head_dim]; queries sit at positions [start, start+T) and the
 * query at position p attends to keys 0..p (params NULL: exact, spec §3), or
 * (params given: sparse prefill, docs/spec.md §7) to its own block's keys
 * up to p plus the blocks chosen for its block: with bs = block_size and
 * k = k_blocks, the rows of block b attend to every block before b when
 * b < k, else to the k - 1 blocks the decode rules (params' knobs) choose
 * among blocks 0 .. b-1, scored by each head's mean query row over block
 * b's rows in this call; the blocks from the one holding position
 * start + T - exact_tail on (the call's last exact_tail rows) are exact
 * whatever b.  `prior` (may be NULL; read only with params) is
 * the importance recorded before this call: the reserve ranks the block
 * sums of prior[0, start).  minmax needs params->bounds, channels
 * params->channels, over start+T rows.
 * out [n_heads, T, head_dim]; importance [start+T] receives the sum over
 * heads and query rows of the softmax weights each key got. */
int sa_prefill(const float *q, int n_heads, int T, const sa_kv *k, const sa_kv *v, int start,
               const sa_select_params *params, const float *prior, int64_t n_prior,
               float scale, float *out, float *importance, int threads);

/* Append T tokens to a cache: rows [at, at+T) of every KV head of k and v
 * from k_new / v_new [n_kv_heads, T, head_dim] (quantised when the cache is
 * q8), then the bounds (if not NULL) of every block those rows touch and
 * the probe-row copies (if not NULL) of the new rows and the channel copy
 * (if not NULL) of every block they touch; the k_rows of each become
 * at + T.  Both inputs are scanned before anything is written
 * (SA_ERR_K_VALUES / SA_ERR_V_VALUES), and nothing here allocates, so a
 * refused call leaves every buffer as it was.  The bounds and the channel
 * copy must be current for `at` rows and the probe-row copies must cover
 * them. */
int sa_kv_append(const sa_kv *k, const sa_kv *v, int at, const float *k_new,
                 const float *v_new, int T, sa_bounds *bounds, sa_probe_rows *probe_rows,
                 sa_channels *channels);

/* sa_kv_append's checks alone (arguments, then both inputs' values), with
 * its arguments; writes nothing.  SA_OK means sa_kv_append with the same
 * arguments, made before anything changes them, succeeds: a batch checks
 * every sequence's append before it makes any. */
int sa_kv_append_check(const sa_kv *k, const sa_kv *v, int at, const float *k_new,
                       const float *v_new, int T, const sa_bounds *bounds,
                       const sa_probe_rows *probe_rows, const sa_channels *channels);

/* Keep a cache's first seq_len rows.  The cache's length is bounds->k_rows
 * (its one record of it: the Python layer reads it there); the probe-row
 * copies (if not NULL) and the channel copy (if not NULL) must be current
 * for that many rows and importance (if not NULL) hold at least that many
 * entries (n_importance).  The bounds and the channel copy of the block
 * holding row seq_len - 1 are recomputed from K's rows when it is now
 * partial, the copies of kept rows stay, importance[seq_len, old length)
 * becomes 0, and the k_rows of each become seq_len.  Everything is checked
 * before anything is written and nothing allocates, so a refused call
 * leaves every buffer as it was and one that returns SA_OK has done all of
 * it: a truncation is one call.  seq_len = 0 empties the cache. */
int sa_kv_truncate(const sa_kv *k, int seq_len, sa_bounds *bounds, sa_probe_rows *probe_rows,
                   sa_channels *channels, float *importance, int64_t n_importance);

/* Recompute the bounds of every block that holds a row in [from_row, to_row)
 * from K's rows [block start, to_row), and set b->k_rows = to_row.
 * from_row = 0 computes bounds from scratch; a cache that drops rows
 * recomputes its new partial last block. */
int sa_bounds_update(const sa_kv *k, int from_row, int to_row, sa_bounds *b);

/* Recompute the channel copy of every block that holds a row in
 * [from_row, to_row) from K's rows [block start, to_row), and set
 * c->k_rows = to_row (from_row = 0: from scratch). */
int sa_channels_update(const sa_kv *k, int from_row, int to_row, sa_channels *c);

/* Copy into p the sampled rows of [from_row, to_row) (those of blocks that
 * fit in p's rows) and set p->k_rows = to_row.  from_row must not be
 * beyond p->k_rows (the copies would have a gap).  from_row = 0 builds the
 * copies from scratch. */
int sa_probe_rows_update(const sa_kv *k, int from_row, int to_row, sa_probe_rows *p);

/* The design card's kernels on their own, for microbenchmarks:
 * q8 dot of one quantised query against n rows of a q8 matrix,
 * and out += sum_t p[t] * v[t] over n rows of a float32 or q8 V. */
int sa_kernel_q8_dot(const int8_t *q, const float *q_scales, int dim, int group_size,
                     const int8_t *rows, const float *row_scales, int n, float *out);
int sa_kernel_accumulate_v(const float *p, const sa_kv *v, int n, float *out);

/* The benchmark's bandwidth probe: read n_bytes of buf (8-byte aligned)
 * once with the widest loads the active ISA has, split over up to `threads`
 * threads (at most 64) in contiguous parts; *checksum receives the sum of
 * its 64-bit words (and of the bytes after the last whole word), the same
 * on every ISA, so the reads happen. */
int sa_stream_read(const void *buf, int64_t n_bytes, int threads, uint64_t *checksum);

/* llama.cpp's attention op (ggml's GGML_OP_FLASH_ATTN_EXT) over its own
 * tensors, read in place (docs/design.md, "The ggml backend").  A tensor is
 * ggml's view of memory: ne[0] is the innermost dimension, nb[i] the bytes
 * from one index of dimension i to the next; rows (dimension 0) are
 * contiguous.  The type ids are ggml's own: F16 is IEEE half, Q8_0 is
 * blocks of 32 values, each an fp16 scale d then 32 int8 q (34 bytes,
 * value d * q), so a Q8_0 row of D values is D / 32 blocks and nb[0] = 34. */
enum sa_ggml_type { SA_GGML_F32 = 0, SA_GGML_F16 = 1, SA_GGML_Q8_0 = 8 };

typedef struct sa_ggml_tensor {
    int type;                 /* enum sa_ggml_type */
    void *data;
    int64_t ne[4];
    int64_t nb[4];
} sa_ggml_tensor;

/* One attention node, in ggml's shapes (D the head size, n_q query rows,
 * H query heads, Hkv KV heads, n_kv KV cells, ns streams):
 *   q     F32          [D, n_q, H, ns]
 *   k, v  F16 or Q8_0  [D, n_kv, Hkv, ns], both of one type; H % Hkv == 0
 *                      and query head h reads KV head h / (H / Hkv)
 *   mask  F16          [>= n_kv, >= n_q, m2, m3] with H % m2 == 0 and
 *                      ns % m3 == 0, or NULL: query row i of head h in
 *                      stream s reads mask row (i, h % m2, s % m3); a cell
 *                      whose value is -Inf is not attended (never read),
 *                      any other value is added to the scaled score
 *   out   F32          [D, H, n_q, ns], contiguous (written, never read)
 * Per query row and head: exact softmax attention over the cells its mask
 * row does not exclude, scores scale * dot(q, k) + mask; a row that may
 * read no cell gets zeros.  Computed in float32 with the active kernel
 * table: F16 K and V converted to float32 rows, Q8_0 K and V to q8 rows
 * with float32 scales (spec §4: the query is quantised as q8 with groups of
 * 32 for the dot), a chunk of cells at a time into per-thread scratch,
 * never a copy of the whole cache.  Bitwise the same for every thread
 * count.  What the entry does not compute is refused with
 * SA_ERR_UNSUPPORTED, not approximated: max_bias (ALiBi), logit_softcap
 * and n_kv_max must be 0, has_sinks 0, and v's D that of q and k.
 *
 * With `select`, the rows of a call of at most SA_GGML_DECODE_ROWS query
 * rows whose mask gives a KV head group one plane (m2 == 1) are attended
 * sparsely (spec §8): per row, blocks of select->block_size consecutive
 * valid cells (mask value not -Inf, in cell order), chosen by the probe
 * and the stateless knobs from K itself, then exact attention over the
 * chosen blocks' cells in the exact path's order; a row with
 * k_blocks >= its blocks is the exact path's, bit for bit.  The selection
 * must be stateless: scoring SA_SCORING_PROBE, importance_blocks 0 and no
 * probe_rows (else SA_ERR_UNSUPPORTED); bounds, channels and exact_tail
 * are not read.  `blocks`, if not NULL, receives per (stream, row, head)
 * the blocks chosen, ascending, k_blocks entries with -1 after the last
 * (blocks[((s * n_q + i) * H + h) * k_blocks + j]); all -1 for a row with
 * no valid cell and for a call computed exactly. */
enum { SA_GGML_DECODE_ROWS = 4 };

typedef struct sa_ggml_attn {
    sa_ggml_tensor q, k, v;
    const sa_ggml_tensor *mask;
    sa_ggml_tensor out;
    float scale;              /* finite and > 0 */
    float max_bias;
    float logit_softcap;
    int n_kv_max;
    int has_sinks;
    const sa_select_params *select; /* NULL: exact */
    int32_t *blocks;          /* NULL, or [ns][n_q][H][select->k_blocks] */
} sa_ggml_attn;

/* Everything sa_ggml_flash_attn checks but the data pointers: SA_OK when
 * it computes this node (a ggml backend's supports_op asks it before any
 * tensor has memory). */
int sa_ggml_flash_attn_check(const sa_ggml_attn *a);

int sa_ggml_flash_attn(const sa_ggml_attn *a, int threads);

/* 1 if sa_ggml_flash_attn chooses blocks for a's rows (a selection, at
 * most SA_GGML_DECODE_ROWS rows, one mask plane), else 0 (exact). */
int sa_ggml_sparse_call(const sa_ggml_attn *a);

/* The ggml backend's settings (spec §8, "Settings"), parsed from the texts
 * of SPARSE_ATTN_K_BLOCKS, SPARSE_ATTN_POLICY and SPARSE_ATTN_DENSE_LAYERS
 * (each NULL or empty: its default) by sa_ggml_settings_parse, which the
 * backend and the Python layer share so that the two read one syntax and
 * one table of presets (sparse_attn/selection.py's POLICIES, checked by
 * tests/test_ggml_sparse.py). */
enum { SA_GGML_MAX_DENSE = 64 };

typedef struct sa_ggml_settings {
    int k_blocks;             /* 0: exact */
    sa_select_params select;  /* read when k_blocks > 0; select.k_blocks == k_blocks */
    int n_dense;
    int dense[SA_GGML_MAX_DENSE]; /* layers kept exact, ascending, distinct */
} sa_ggml_settings;

/* SA_OK and *out, or SA_ERR_PARAM (SA_ERR_UNSUPPORTED for a policy that
 * needs state) with the reason in why (why_len bytes, NUL-terminated);
 * *out is written only on success. */
int sa_ggml_settings_parse(const char *k_blocks, const char *policy, const char *dense_layers,
                           sa_ggml_settings *out, char *why, int why_len);

/* The settings as the three texts again ("k_blocks=32 policy=seed:...
 * dense_layers=0+1"), into buf (len bytes); the length it needs. */
int sa_ggml_settings_format(const sa_ggml_settings *s, char *buf, int len);

/* 1 if `layer` is in s's dense layers (or s is exact), else 0. */
int sa_ggml_settings_exact(const sa_ggml_settings *s, int layer);
/* cdef-end */

#define SA_VALUE_LIMIT 281474976710656.0f /* 2^SA_VALUE_LIMIT_LOG2 */

#endif
