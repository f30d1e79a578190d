/* hierps.storage._native._core: the loops over bytes of the SSD tier, compiled.
 *
 * Every function takes and fills buffers (the buffer protocol: numpy arrays, bytes, memoryviews),
 * checks every offset and length it is given before it touches a byte, and runs its loop with the
 * GIL released, so that the read threads check and gather on every core while training goes on.
 * Each one computes exactly what the numpy code beside it computes (hierps.storage._reads,
 * _arrays, _filter); tests/test_native.py holds them to it.
 *
 * crc32c is the Castagnoli CRC of the `crc32c` package (crc32c(data, value) continues `value`):
 * with SSE4.2's crc32 instruction, three streams at once, when the CPU has it (asked at run time),
 * else a slice-by-8 table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define HIERPS_X86 1
#include <nmmintrin.h>
#endif

#define POLY 0x82f63b78u /* crc32c, reflected */
#define TRAILER 8        /* after each chunk's payload: its crc32c, then its binding tag */

static uint32_t table8[8][256];

/* -- portable crc32c ------------------------------------------------------------------------ */
static void init_tables(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table8[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = table8[0][n];
        for (int k = 1; k < 8; k++) {
            c = table8[0][c & 0xff] ^ (c >> 8);
            table8[k][n] = c;
        }
    }
}

static inline uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint32_t load32le(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void store32le(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t len) {
    crc = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        crc = table8[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w = load64(p) ^ crc;
        crc = table8[7][w & 0xff] ^ table8[6][(w >> 8) & 0xff] ^ table8[5][(w >> 16) & 0xff] ^
              table8[4][(w >> 24) & 0xff] ^ table8[3][(w >> 32) & 0xff] ^ table8[2][(w >> 40) & 0xff] ^
              table8[1][(w >> 48) & 0xff] ^ table8[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) crc = table8[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

/* -- hardware crc32c: three interleaved streams, joined by "append n zero bytes" operators ------ */
#ifdef HIERPS_X86
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256
static uint32_t zeros_long[4][256], zeros_short[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends `len` zero bytes (a power of two) to a crc, as four byte tables. */
static void zeros_tables(uint32_t zeros[4][256], size_t len) {
    uint32_t even[32], odd[32], row = 1;
    odd[0] = POLY;
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* 2 zero bits */
    gf2_square(odd, even); /* 4 zero bits */
    const uint32_t *op = even;
    for (;;) {
        gf2_square(even, odd); /* 1, 4, 16, ... zero bytes */
        op = even;
        len >>= 1;
        if (!len) break;
        gf2_square(odd, even); /* 2, 8, 32, ... */
        op = odd;
        len >>= 1;
        if (!len) break;
    }
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift_crc(uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t len) {
    uint64_t c0 = ~crc & 0xffffffffu, c1, c2;
    while (len && ((uintptr_t)p & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
        len--;
    }
    while (len >= 3 * LONG_BLOCK) {
        c1 = c2 = 0;
        const unsigned char *end = p + LONG_BLOCK;
        do {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + LONG_BLOCK));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * LONG_BLOCK));
            p += 8;
        } while (p < end);
        c0 = shift_crc(zeros_long, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift_crc(zeros_long, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * LONG_BLOCK;
        len -= 3 * LONG_BLOCK;
    }
    while (len >= 3 * SHORT_BLOCK) {
        c1 = c2 = 0;
        const unsigned char *end = p + SHORT_BLOCK;
        do {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + SHORT_BLOCK));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * SHORT_BLOCK));
            p += 8;
        } while (p < end);
        c0 = shift_crc(zeros_short, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift_crc(zeros_short, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * SHORT_BLOCK;
        len -= 3 * SHORT_BLOCK;
    }
    while (len >= 8) {
        c0 = _mm_crc32_u64(c0, load64(p));
        p += 8;
        len -= 8;
    }
    while (len--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return ~(uint32_t)c0;
}
#endif

static int have_hw = 0;

static inline uint32_t crc_update(uint32_t crc, const unsigned char *p, size_t len) {
#ifdef HIERPS_X86
    if (have_hw) return crc_hw(crc, p, len);
#endif
    return crc_sw(crc, p, len);
}

/* The binding tag of chunk `chunk` whose crc32c is `crc`, in an array of `seed`. */
static inline uint32_t binding_tag(uint32_t seed, uint64_t chunk, uint32_t crc) {
    unsigned char item[12];
    for (int b = 0; b < 8; b++) item[b] = (unsigned char)(chunk >> (8 * b));
    store32le(item + 8, crc);
    return crc_update(seed, item, 12);
}

/* -- the GIL -------------------------------------------------------------------------------- */
/* A loop lets the GIL go (other threads run Python meanwhile) when its work is large: for a short one,
 * taking the GIL back (up to the interpreter's switch interval while other threads run Python) would
 * cost more than it frees. `work` counts bytes touched, about. Reads let it go always (they wait). */
#define BIG_WORK (256 * 1024)
#define UNLOCK_IF(work) \
    {               \
        PyThreadState *_save = (work) >= BIG_WORK ? PyEval_SaveThread() : NULL;
#define RELOCK                                \
    if (_save) PyEval_RestoreThread(_save); \
    }

/* -- buffers -------------------------------------------------------------------------------- */
typedef struct {
    Py_buffer view;
    int held;
} Buf;

static void release(Buf *b) {
    if (b->held) PyBuffer_Release(&b->view);
    b->held = 0;
}

/* A C-contiguous buffer of bytes (any format), writable when asked. */
static int get_bytes(PyObject *obj, Buf *b, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    b->held = 1;
    return 0;
}

/* A C-contiguous buffer of 8-byte integers in native order (a numpy int64 / uint64 array). */
static int get_words(PyObject *obj, Buf *b, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, &b->view,
                           PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous%s int64 array", what,
                     writable ? " writable" : "");
        return -1;
    }
    b->held = 1;
    const char *f = b->view.format ? b->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (b->view.itemsize != 8 || strlen(f) != 1 || !strchr("qQlL", *f)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int64 array, got format %s of %zd bytes", what,
                     b->view.format ? b->view.format : "B", b->view.itemsize);
        release(b);
        return -1;
    }
    return 0;
}

#define NWORDS(b) ((b).view.len / 8)
#define WORDS(b) ((const int64_t *)(b).view.buf)

/* -- crc32c(data, value=0) ------------------------------------------------------------------ */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "O|k", &obj, &value)) return NULL;
    Buf b = {0};
    if (get_bytes(obj, &b, 0, "crc32c data") < 0) return NULL;
    uint32_t crc = (uint32_t)value;
    const unsigned char *p = b.view.buf;
    size_t len = (size_t)b.view.len;
    UNLOCK_IF((Py_ssize_t)len) crc = crc_update(crc, p, len);
    RELOCK
    release(&b);
    return PyLong_FromUnsignedLong(crc);
}

/* -- check_gather ---------------------------------------------------------------------------- */
typedef struct {
    const unsigned char *buf;
    Py_ssize_t buf_len;
    const int64_t *at, *chunks, *pos, *slot;
    int64_t at_base;    /* subtracted from every offset in `at` */
    Py_ssize_t base;    /* added to the chunk indices reported */
    Py_ssize_t n_chunks, n_rows;
    Py_ssize_t payload, chunk_rows, row_bytes;
    uint32_t seed;
    unsigned char *out;
    /* results: index of the first chunk whose crc fails (-1: none) and their count; likewise for the
     * binding tags of chunks whose crc passes */
    Py_ssize_t bad_crc, n_bad_crc, bad_tag, n_bad_tag;
    const char *error;
    Py_ssize_t error_at;
} Gather;

static inline void check_chunk(Gather *g, Py_ssize_t i) {
    const unsigned char *c = g->buf + (g->at[i] - g->at_base);
    uint32_t crc = crc_update(0, c, (size_t)g->payload);
    if (crc != load32le(c + g->payload)) {
        if (g->bad_crc < 0) g->bad_crc = g->base + i;
        g->n_bad_crc++;
    } else if (binding_tag(g->seed, (uint64_t)g->chunks[i], crc) != load32le(c + g->payload + 4)) {
        if (g->bad_tag < 0) g->bad_tag = g->base + i;
        g->n_bad_tag++;
    }
}

/* Copies rows, joining copies of rows that follow each other in both source and output. */
typedef struct {
    const unsigned char *src;
    unsigned char *dst;
    size_t len;
} Copy;

static inline void copy_row(Copy *cp, const unsigned char *src, unsigned char *dst, size_t n) {
    if (cp->len && cp->src + cp->len == src && cp->dst + cp->len == dst) {
        cp->len += n;
        return;
    }
    if (cp->len) memcpy(cp->dst, cp->src, cp->len);
    cp->src = src;
    cp->dst = dst;
    cp->len = n;
}

static inline void flush(Copy *cp) {
    if (cp->len) memcpy(cp->dst, cp->src, cp->len);
    cp->len = 0;
}

/* Row j of chunk i: its bytes in buf, or NULL (and g->error) when it is not in that chunk. */
static inline const unsigned char *row_in(Gather *g, Py_ssize_t i, Py_ssize_t j) {
    int64_t r = g->pos[j] - g->chunks[i] * g->chunk_rows;
    if (r < 0 || r >= g->chunk_rows) {
        g->error = "a row asked for is not in the chunk given for it";
        g->error_at = j;
        return NULL;
    }
    return g->buf + (g->at[i] - g->at_base) + r * g->row_bytes;
}

static void run_gather(Gather *g) {
    Copy cp = {0};
    size_t rb = (size_t)g->row_bytes;
    for (Py_ssize_t i = 0; i < g->n_chunks; i++) {
        int64_t a = g->at[i] - g->at_base;
        if (a < 0 || a > g->buf_len - g->payload - TRAILER) {
            g->error = "a chunk lies outside the buffer";
            g->error_at = i;
            return;
        }
    }
    if (g->slot == NULL) {
        /* Sorted rows in sorted chunks: each chunk is checked, then its rows copied while in cache. */
        Py_ssize_t j = 0;
        for (Py_ssize_t i = 0; i < g->n_chunks; i++) {
            check_chunk(g, i);
            if (!g->out) continue;
            int64_t end = (g->chunks[i] + 1) * g->chunk_rows;
            for (; j < g->n_rows && g->pos[j] < end; j++) {
                const unsigned char *src = row_in(g, i, j);
                if (!src) return;
                copy_row(&cp, src, g->out + j * rb, rb);
            }
        }
        flush(&cp);
        if (g->out && j < g->n_rows) {
            g->error = "a row asked for lies after the last chunk given";
            g->error_at = j;
        }
        return;
    }
    for (Py_ssize_t i = 0; i < g->n_chunks; i++) check_chunk(g, i);
    if (!g->out) return;
    for (Py_ssize_t j = 0; j < g->n_rows; j++) {
        int64_t i = g->slot[j];
        if (i < 0 || i >= g->n_chunks) {
            g->error = "a row's slot names no chunk given";
            g->error_at = j;
            return;
        }
        const unsigned char *src = row_in(g, (Py_ssize_t)i, j);
        if (!src) return;
        copy_row(&cp, src, g->out + j * rb, rb);
    }
    flush(&cp);
}

static PyObject *py_check_gather(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"buf",       "at",  "chunks", "payload", "seed", "pos", "chunk_rows",
                            "row_bytes", "out", "slot",   NULL};
    PyObject *o_buf, *o_at, *o_chunks, *o_pos, *o_out, *o_slot = Py_None;
    Py_ssize_t payload, chunk_rows, row_bytes;
    unsigned long seed;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOnkOnnO|O", names, &o_buf, &o_at, &o_chunks, &payload,
                                     &seed, &o_pos, &chunk_rows, &row_bytes, &o_out, &o_slot))
        return NULL;
    Buf buf = {0}, at = {0}, chunks = {0}, pos = {0}, out = {0}, slot = {0};
    PyObject *result = NULL;
    if (get_bytes(o_buf, &buf, 0, "buf") < 0 || get_words(o_at, &at, 0, "at") < 0 ||
        get_words(o_chunks, &chunks, 0, "chunks") < 0 || get_words(o_pos, &pos, 0, "pos") < 0 ||
        (o_out != Py_None && get_bytes(o_out, &out, 1, "out") < 0) ||
        (o_slot != Py_None && get_words(o_slot, &slot, 0, "slot") < 0))
        goto done;
    if (payload < 0 || chunk_rows <= 0 || row_bytes <= 0 || chunk_rows * row_bytes > payload ||
        NWORDS(at) != NWORDS(chunks)) {
        PyErr_SetString(PyExc_ValueError,
                        "check_gather: expected payload >= chunk_rows * row_bytes > 0 and one offset per chunk");
        goto done;
    }
    if (out.held && (out.view.len != NWORDS(pos) * row_bytes || (slot.held && NWORDS(slot) != NWORDS(pos)))) {
        PyErr_Format(PyExc_ValueError, "check_gather: out holds %zd bytes, not %zd rows of %zd bytes (and a slot each)",
                     out.view.len, NWORDS(pos), row_bytes);
        goto done;
    }
    Gather g = {buf.view.buf, buf.view.len, WORDS(at), WORDS(chunks), WORDS(pos),
                slot.held ? WORDS(slot) : NULL, 0, 0, NWORDS(at), NWORDS(pos), payload, chunk_rows, row_bytes,
                (uint32_t)seed, out.held ? out.view.buf : NULL, -1, 0, -1, 0, NULL, 0};
    UNLOCK_IF(g.n_chunks * payload + g.n_rows * row_bytes) run_gather(&g);
    RELOCK
    if (g.error) {
        PyErr_Format(PyExc_ValueError, "check_gather: %s (index %zd)", g.error, g.error_at);
        goto done;
    }
    result = Py_BuildValue("nnnn", g.bad_crc, g.n_bad_crc, g.bad_tag, g.n_bad_tag);
done:
    release(&buf);
    release(&at);
    release(&chunks);
    release(&pos);
    release(&out);
    release(&slot);
    return result;
}

/* -- plan_chunks ---------------------------------------------------------------------------- */
/* plan_chunks(pos, chunk_rows, n, chunks) -> (c, kind, min, max): the rows `pos` (k,) of an array of n
 * rows in chunks of chunk_rows. kind 0: a row lies outside the array (min, max say which); 1: a range of
 * consecutive rows; 2: rows in chunk order; 3: rows out of chunk order (nothing filled). For 1 and 2,
 * chunks[:c] holds the chunks holding them, in order, each once. */
static PyObject *py_plan_chunks(PyObject *self, PyObject *args) {
    PyObject *o_pos, *o_chunks;
    Py_ssize_t chunk_rows, n;
    if (!PyArg_ParseTuple(args, "OnnO", &o_pos, &chunk_rows, &n, &o_chunks)) return NULL;
    Buf pos = {0}, chunks = {0};
    PyObject *result = NULL;
    if (get_words(o_pos, &pos, 0, "pos") < 0 || get_words(o_chunks, &chunks, 1, "chunks") < 0) goto done;
    Py_ssize_t k = NWORDS(pos);
    if (k < 1 || NWORDS(chunks) < k || chunk_rows < 1) {
        PyErr_SetString(PyExc_ValueError, "plan_chunks: expected rows and room for a chunk each");
        goto done;
    }
    const int64_t *p = WORDS(pos);
    int64_t *ch = (int64_t *)chunks.view.buf, lo = p[0], hi = p[0];
    Py_ssize_t c = 0;
    int kind = 1;
    UNLOCK_IF(16 * k) for (Py_ssize_t j = 0; j < k; j++) {
        if (p[j] < lo) lo = p[j];
        if (p[j] > hi) hi = p[j];
    }
    if (lo < 0 || hi >= n) kind = 0;
    for (Py_ssize_t j = 1; kind == 1 && j < k; j++)
        if (p[j] != p[j - 1] + 1) kind = 2;
    if (kind == 1) {
        for (int64_t q = p[0] / chunk_rows; q <= p[k - 1] / chunk_rows; q++) ch[c++] = q;
    } else if (kind == 2) {
        for (Py_ssize_t j = 0; j < k && kind == 2; j++) {
            int64_t q = p[j] / chunk_rows;
            if (c == 0 || q > ch[c - 1])
                ch[c++] = q;
            else if (q < ch[c - 1])
                kind = 3;
        }
    }
    RELOCK result = Py_BuildValue("niLL", kind == 1 || kind == 2 ? c : 0, kind, (long long)lo,
                                                 (long long)hi);
done:
    release(&pos);
    release(&chunks);
    return result;
}

/* -- plan_runs ------------------------------------------------------------------------------ */
/* Chunks at offsets `start` (c,) of files `file` (c,), each `chunk_bytes` long, into runs of one pread:
 * same file, in order, gaps up to `gap` bytes read through, cut where the offset from the first chunk
 * of such a group crosses a multiple of `piece`. Fills at (c,): where each chunk lies in the request's
 * buffer; run_chunk (r + 1,): each run's first chunk, then c; run_file, run_start (r,); run_dest (r + 1,):
 * each run's offset in the buffer, then its size; with `pos` (k,) rows in chunk order of chunks
 * `chunks` (c,) of `chunk_rows` rows, run_row (r + 1,): each run's first row, then k. Returns r. */
static PyObject *py_plan_runs(PyObject *self, PyObject *args) {
    PyObject *o_start, *o_file, *o_at, *o_chunk, *o_rfile, *o_rstart, *o_dest, *o_pos, *o_chunks, *o_row;
    Py_ssize_t chunk_bytes, gap, piece, chunk_rows;
    if (!PyArg_ParseTuple(args, "OOnnnOOOOOOOnO", &o_start, &o_file, &chunk_bytes, &gap, &piece, &o_at, &o_chunk,
                          &o_rfile, &o_rstart, &o_dest, &o_pos, &o_chunks, &chunk_rows, &o_row))
        return NULL;
    Buf start = {0}, file = {0}, at = {0}, chunk = {0}, rfile = {0}, rstart = {0}, dest = {0}, pos = {0},
        chunks = {0}, row = {0};
    PyObject *result = NULL;
    int with_rows = o_pos != Py_None;
    if (get_words(o_start, &start, 0, "start") < 0 || get_words(o_file, &file, 0, "file") < 0 ||
        get_words(o_at, &at, 1, "at") < 0 || get_words(o_chunk, &chunk, 1, "run_chunk") < 0 ||
        get_words(o_rfile, &rfile, 1, "run_file") < 0 || get_words(o_rstart, &rstart, 1, "run_start") < 0 ||
        get_words(o_dest, &dest, 1, "run_dest") < 0 ||
        (with_rows && (get_words(o_pos, &pos, 0, "pos") < 0 || get_words(o_chunks, &chunks, 0, "chunks") < 0 ||
                       get_words(o_row, &row, 1, "run_row") < 0)))
        goto done;
    Py_ssize_t c = NWORDS(start);
    if (c < 1 || NWORDS(file) != c || NWORDS(at) != c || NWORDS(chunk) != c + 1 || NWORDS(rfile) != c ||
        NWORDS(rstart) != c || NWORDS(dest) != c + 1 || chunk_bytes <= 0 || gap < 0 || piece <= 0 ||
        (with_rows && (NWORDS(chunks) != c || NWORDS(row) != c + 1 || chunk_rows <= 0))) {
        PyErr_SetString(PyExc_ValueError, "plan_runs: expected c >= 1 chunks and room for c runs");
        goto done;
    }
    const int64_t *st = WORDS(start), *fl = WORDS(file);
    int64_t *a = (int64_t *)at.view.buf, *rc = (int64_t *)chunk.view.buf, *rf = (int64_t *)rfile.view.buf,
            *rs = (int64_t *)rstart.view.buf, *rd = (int64_t *)dest.view.buf;
    Py_ssize_t r = 0;
    UNLOCK_IF(48 * c + (with_rows ? 8 * NWORDS(pos) : 0)) int64_t group = 0, prev_piece = 0;
    rd[0] = 0;
    for (Py_ssize_t i = 0; i < c; i++) {
        int new_group = i == 0 || fl[i] != fl[i - 1] || st[i] - st[i - 1] - chunk_bytes > gap || st[i] < st[i - 1];
        if (new_group) group = st[i];
        int64_t p = (st[i] - group) / piece;
        if (new_group || p != prev_piece) {
            if (r) rd[r] = rd[r - 1] + (st[i - 1] + chunk_bytes - rs[r - 1]);
            rc[r] = i;
            rs[r] = st[i];
            rf[r] = fl[i];
            r++;
        }
        prev_piece = p;
        a[i] = rd[r - 1] + st[i] - rs[r - 1];
    }
    rd[r] = rd[r - 1] + (st[c - 1] + chunk_bytes - rs[r - 1]);
    rc[r] = c;
    if (with_rows) {
        const int64_t *ps = WORDS(pos), *ch = WORDS(chunks);
        int64_t *rr = (int64_t *)row.view.buf;
        Py_ssize_t k = NWORDS(pos), j = 0;
        for (Py_ssize_t i = 0; i < r; i++) {
            int64_t first_row = ch[rc[i]] * chunk_rows;
            while (j < k && ps[j] < first_row) j++;
            rr[i] = j;
        }
        rr[r] = k;
    }
    RELOCK result = PyLong_FromSsize_t(r);
done:
    release(&start);
    release(&file);
    release(&at);
    release(&chunk);
    release(&rfile);
    release(&rstart);
    release(&dest);
    release(&pos);
    release(&chunks);
    release(&row);
    return result;
}

/* -- read_check_gather ---------------------------------------------------------------------- */
/* Runs first..stop-1, one after the other: pread run i (bytes run_dest[i + 1] - run_dest[i] at
 * run_start[i] of fds[i]) into `scratch` (retrying short reads and EINTR), then at once, while its bytes
 * are in the cache, check_gather its chunks (run_chunk[i]..run_chunk[i + 1]) and rows
 * (run_row[i]..run_row[i + 1]) into `out`.
 * With `cached`, only what the page cache holds: each run is read with RWF_NOWAIT, and the first run
 * not wholly there (or a kernel or file system without it) stops the call, as failed with -EAGAIN, for
 * a blocking read to take it up. Such a call keeps the GIL when its bytes are few (it cannot wait on
 * the device, and taking the GIL back would cost more). */
#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif

static ssize_t read_run(int fd, unsigned char *b, size_t len, off_t at, int cached) {
#ifdef __linux__
    if (cached) { /* any short answer (tmpfs: EOPNOTSUPP; an older kernel: EINVAL) means "not there" */
        struct iovec iov = {b, len};
        return preadv2(fd, &iov, 1, at, RWF_NOWAIT);
    }
#else
    if (cached) {
        errno = EAGAIN;
        return -1;
    }
#endif
    return pread(fd, b, len, at);
}
static PyObject *py_read_check_gather(PyObject *self, PyObject *args) {
    PyObject *o_fds, *o_start, *o_dest, *o_chunk, *o_row, *o_scratch, *o_at, *o_chunks, *o_pos, *o_out;
    Py_ssize_t first, stop, payload, chunk_rows, row_bytes;
    unsigned long seed;
    int cached = 0;
    if (!PyArg_ParseTuple(args, "OOOOOnnOOOOnknnO|p", &o_fds, &o_start, &o_dest, &o_chunk, &o_row, &first, &stop,
                          &o_scratch, &o_at, &o_chunks, &o_pos, &payload, &seed, &chunk_rows, &row_bytes, &o_out,
                          &cached))
        return NULL;
    Buf fds = {0}, start = {0}, dest = {0}, chunk = {0}, row = {0}, scratch = {0}, at = {0}, chunks = {0},
        pos = {0}, out = {0};
    PyObject *result = NULL;
    if (get_words(o_fds, &fds, 0, "fds") < 0 || get_words(o_start, &start, 0, "run_start") < 0 ||
        get_words(o_dest, &dest, 0, "run_dest") < 0 || get_words(o_chunk, &chunk, 0, "run_chunk") < 0 ||
        get_words(o_row, &row, 0, "run_row") < 0 || get_bytes(o_scratch, &scratch, 1, "scratch") < 0 ||
        get_words(o_at, &at, 0, "at") < 0 || get_words(o_chunks, &chunks, 0, "chunks") < 0 ||
        get_words(o_pos, &pos, 0, "pos") < 0 || get_bytes(o_out, &out, 1, "out") < 0)
        goto done;
    Py_ssize_t n_runs = NWORDS(fds);
    const int64_t *fd = WORDS(fds), *st = WORDS(start), *ds = WORDS(dest), *rc = WORDS(chunk), *rr = WORDS(row);
    if (NWORDS(start) != n_runs || NWORDS(dest) != n_runs + 1 || NWORDS(chunk) != n_runs + 1 ||
        NWORDS(row) != n_runs + 1 || first < 0 || first >= stop || stop > n_runs || NWORDS(at) != NWORDS(chunks) ||
        chunk_rows <= 0 || row_bytes <= 0 || chunk_rows * row_bytes > payload ||
        out.view.len != NWORDS(pos) * row_bytes) {
        PyErr_SetString(PyExc_ValueError, "read_check_gather: runs, chunks and rows do not match");
        goto done;
    }
    for (Py_ssize_t i = first; i < stop; i++) {
        if (st[i] < 0 || ds[i + 1] < ds[i] || ds[i + 1] - ds[i] > scratch.view.len || fd[i] < 0 ||
            fd[i] > INT32_MAX || rc[i] < 0 || rc[i + 1] < rc[i] || rc[i + 1] > NWORDS(chunks) || rr[i] < 0 ||
            rr[i + 1] < rr[i] || rr[i + 1] > NWORDS(pos)) {
            PyErr_Format(PyExc_ValueError, "read_check_gather: run %zd does not fit the buffers", i);
            goto done;
        }
    }
    unsigned char *b = scratch.view.buf;
    Py_ssize_t failed = -1;
    int64_t got = 0;
    Gather g = {b, 0, WORDS(at), WORDS(chunks), WORDS(pos), NULL, 0, 0, 0, 0, payload, chunk_rows, row_bytes,
                (uint32_t)seed, NULL, -1, 0, -1, 0, NULL, 0};
    const int64_t *all_at = WORDS(at), *all_chunks = WORDS(chunks), *all_pos = WORDS(pos);
    PyThreadState *save = !cached || ds[stop] - ds[first] >= BIG_WORK ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = first; i < stop; i++) {
        int64_t len = ds[i + 1] - ds[i];
        got = 0;
        while (got < len) {
            ssize_t r = read_run((int)fd[i], b + got, (size_t)(len - got), (off_t)(st[i] + got), cached);
            if (r < 0 && errno == EINTR) continue;
            if (cached && r < len - got) { /* not all in the page cache: a blocking read takes it up */
                got = -EAGAIN;
                break;
            }
            if (r <= 0) {
                if (r < 0) got = -(int64_t)errno;
                break;
            }
            got += r;
        }
        if (got != len) {
            failed = i;
            break;
        }
        g.buf_len = len;
        g.at_base = ds[i];
        g.base = (Py_ssize_t)rc[i];
        g.at = all_at + rc[i];
        g.chunks = all_chunks + rc[i];
        g.n_chunks = rc[i + 1] - rc[i];
        g.pos = all_pos + rr[i];
        g.n_rows = rr[i + 1] - rr[i];
        g.out = (unsigned char *)out.view.buf + rr[i] * row_bytes;
        run_gather(&g);
        if (g.error) break;
    }
    if (save) PyEval_RestoreThread(save);
    if (g.error) {
        PyErr_Format(PyExc_ValueError, "read_check_gather: %s (index %zd)", g.error, g.error_at);
        goto done;
    }
    result = Py_BuildValue("nLnnnn", failed, (long long)(failed < 0 ? 0 : got), g.bad_crc, g.n_bad_crc, g.bad_tag,
                           g.n_bad_tag);
done:
    release(&fds);
    release(&start);
    release(&dest);
    release(&chunk);
    release(&row);
    release(&scratch);
    release(&at);
    release(&chunks);
    release(&pos);
    release(&out);
    return result;
}

/* -- encode_chunks ---------------------------------------------------------------------------- */
/* Rows of bytes, each contiguous, the rows any (positive) step apart: a 2-d uint8 view such as a
 * column slice of a wider array. */
static int get_rows(PyObject *obj, Buf *b, const char *what) {
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_STRIDES) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a 2-d buffer of bytes", what);
        return -1;
    }
    b->held = 1;
    if (b->view.ndim != 2 || b->view.itemsize != 1 || b->view.strides[1] != 1 ||
        (b->view.shape[0] > 1 && b->view.strides[0] < b->view.shape[1])) {
        PyErr_Format(PyExc_TypeError, "%s: expected (n, row bytes) uint8 rows, each contiguous, in order", what);
        release(b);
        return -1;
    }
    return 0;
}

static PyObject *py_encode_chunks(PyObject *self, PyObject *args) {
    PyObject *o_src, *o_out;
    Py_ssize_t chunk_rows, stride;
    unsigned long long first;
    unsigned long seed, content;
    if (!PyArg_ParseTuple(args, "OnKknOk", &o_src, &chunk_rows, &first, &seed, &stride, &o_out, &content))
        return NULL;
    Buf src = {0}, out = {0};
    PyObject *result = NULL;
    if (get_rows(o_src, &src, "rows") < 0 || get_bytes(o_out, &out, 1, "out") < 0) goto done;
    Py_ssize_t rows = src.view.shape[0], row_bytes = src.view.shape[1], step = src.view.strides[0];
    Py_ssize_t payload = chunk_rows * row_bytes;
    if (chunk_rows <= 0 || row_bytes <= 0 || rows % chunk_rows || stride < payload + TRAILER ||
        out.view.len != rows / chunk_rows * stride) {
        PyErr_SetString(PyExc_ValueError,
                        "encode_chunks: expected whole chunks of rows and an output of one stride (>= payload + 8) each");
        goto done;
    }
    Py_ssize_t n = rows / chunk_rows;
    const unsigned char *s = src.view.buf;
    unsigned char *o = out.view.buf;
    uint32_t seed32 = (uint32_t)seed, whole = (uint32_t)content;
    UNLOCK_IF(n * stride) for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char *c = o + i * stride;
        if (step == row_bytes) {
            memcpy(c, s + i * payload, (size_t)payload);
        } else {
            const unsigned char *r = s + i * chunk_rows * step;
            for (Py_ssize_t j = 0; j < chunk_rows; j++) memcpy(c + j * row_bytes, r + j * step, (size_t)row_bytes);
        }
        uint32_t crc = crc_update(0, c, (size_t)payload);
        whole = crc_update(whole, c, (size_t)payload); /* the array's content: its rows' bytes in order */
        store32le(c + payload, crc);
        store32le(c + payload + 4, binding_tag(seed32, first + (uint64_t)i, crc));
        memset(c + payload + TRAILER, 0, (size_t)(stride - payload - TRAILER));
    }
    RELOCK result = PyLong_FromUnsignedLong(whole);
done:
    release(&src);
    release(&out);
    return result;
}

/* -- binding_tags ----------------------------------------------------------------------------- */
static PyObject *py_binding_tags(PyObject *self, PyObject *args) {
    PyObject *o_chunks, *o_crcs, *o_out;
    unsigned long seed;
    if (!PyArg_ParseTuple(args, "OOkO", &o_chunks, &o_crcs, &seed, &o_out)) return NULL;
    Buf chunks = {0}, crcs = {0}, out = {0};
    PyObject *result = NULL;
    if (get_words(o_chunks, &chunks, 0, "chunks") < 0 || get_bytes(o_crcs, &crcs, 0, "crcs") < 0 ||
        get_bytes(o_out, &out, 1, "out") < 0)
        goto done;
    Py_ssize_t n = NWORDS(chunks);
    if (crcs.view.len != 4 * n || out.view.len != 4 * n) {
        PyErr_SetString(PyExc_ValueError, "binding_tags: expected one uint32 crc and one uint32 tag per chunk");
        goto done;
    }
    const int64_t *ch = WORDS(chunks);
    const unsigned char *cr = crcs.view.buf;
    unsigned char *o = out.view.buf;
    uint32_t seed32 = (uint32_t)seed;
    UNLOCK_IF(16 * n) for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t crc;
        memcpy(&crc, cr + 4 * i, 4); /* native order, as numpy's uint32 */
        uint32_t tag = binding_tag(seed32, (uint64_t)ch[i], crc);
        memcpy(o + 4 * i, &tag, 4);
    }
    RELOCK result = Py_NewRef(Py_None);
done:
    release(&chunks);
    release(&crcs);
    release(&out);
    return result;
}

/* -- blocked Bloom filters (hierps.storage._filter) ------------------------------------------- */
#define PROBES 6 /* bits set per key, all in one 64-bit word */

static inline uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The word (of `words` from `first`) and the bits of `key`. */
static inline uint64_t probe(uint64_t key, uint64_t words, uint64_t *mask) {
    uint64_t h = splitmix64(key), h2 = splitmix64(h), m = 0;
    for (int i = 0; i < PROBES; i++) m |= 1ull << ((h2 >> (6 * i)) & 63);
    *mask = m;
    return ((h >> 32) * words) >> 32;
}

/* bloom_add(filt, keys): set the bits of keys in the one-block filter filt. */
static PyObject *py_bloom_add(PyObject *self, PyObject *args) {
    PyObject *o_filt, *o_keys;
    if (!PyArg_ParseTuple(args, "OO", &o_filt, &o_keys)) return NULL;
    Buf filt = {0}, keys = {0};
    PyObject *result = NULL;
    if (get_words(o_filt, &filt, 1, "filter") < 0 || get_words(o_keys, &keys, 0, "keys") < 0) goto done;
    Py_ssize_t w = NWORDS(filt), n = NWORDS(keys);
    if (w < 1) {
        PyErr_SetString(PyExc_ValueError, "bloom_add: a filter has at least one word");
        goto done;
    }
    uint64_t *f = filt.view.buf;
    const uint64_t *k = keys.view.buf;
    /* In groups of 32 keys: their words fetched (prefetched) together, then their bits set, so that
     * the cache misses of a large filter overlap instead of following one another. */
    UNLOCK_IF(64 * n) uint64_t word[32], mask[32];
    for (Py_ssize_t i = 0; i < n; i += 32) {
        int m = n - i < 32 ? (int)(n - i) : 32;
        for (int j = 0; j < m; j++) {
            word[j] = probe(k[i + j], (uint64_t)w, &mask[j]);
            __builtin_prefetch(f + word[j], 1);
        }
        for (int j = 0; j < m; j++) f[word[j]] |= mask[j];
    }
    RELOCK result = Py_NewRef(Py_None);
done:
    release(&filt);
    release(&keys);
    return result;
}

/* bloom_may_contain(filt, keys, block, full_words, out): out[i] = 0 where the filter proves keys[i]
 * absent. block None: one block (all of filt); else key i is in block block[i] of full_words words
 * (the last block: what is left of filt). */
static PyObject *py_bloom_may_contain(PyObject *self, PyObject *args) {
    PyObject *o_filt, *o_keys, *o_block, *o_out;
    Py_ssize_t full;
    if (!PyArg_ParseTuple(args, "OOOnO", &o_filt, &o_keys, &o_block, &full, &o_out)) return NULL;
    Buf filt = {0}, keys = {0}, block = {0}, out = {0};
    PyObject *result = NULL;
    if (get_words(o_filt, &filt, 0, "filter") < 0 || get_words(o_keys, &keys, 0, "keys") < 0 ||
        (o_block != Py_None && get_words(o_block, &block, 0, "block") < 0) || get_bytes(o_out, &out, 1, "out") < 0)
        goto done;
    Py_ssize_t w = NWORDS(filt), n = NWORDS(keys);
    if (w < 1 || out.view.len != n || (block.held && (NWORDS(block) != n || full < 1))) {
        PyErr_SetString(PyExc_ValueError, "bloom_may_contain: expected a filter, one block and one bool per key");
        goto done;
    }
    const uint64_t *f = filt.view.buf, *k = keys.view.buf;
    const int64_t *b = block.held ? WORDS(block) : NULL;
    unsigned char *o = out.view.buf;
    Py_ssize_t bad = -1;
    UNLOCK_IF(64 * n) int64_t last_first = b ? (w - 1) / full * full : 0;
    uint64_t at[32], mask[32];
    for (Py_ssize_t i = 0; i < n && bad < 0; i += 32) { /* in groups, prefetched as bloom_add's */
        int m = n - i < 32 ? (int)(n - i) : 32;
        for (int j = 0; j < m; j++) {
            int64_t first = 0, words = w;
            if (b) {
                first = b[i + j] * full;
                words = first >= last_first ? w - first : full;
                if (b[i + j] < 0 || words < 1) {
                    bad = i + j;
                    break;
                }
            }
            at[j] = (uint64_t)first + probe(k[i + j], (uint64_t)words, &mask[j]);
            __builtin_prefetch(f + at[j], 0);
        }
        if (bad >= 0) break;
        for (int j = 0; j < m; j++) o[i + j] = (f[at[j]] & mask[j]) == mask[j];
    }
    RELOCK if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "bloom_may_contain: key %zd's block %lld lies outside the filter", bad,
                     (long long)b[bad]);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release(&filt);
    release(&keys);
    release(&block);
    release(&out);
    return result;
}

/* -- the device tier's key -> slot index (hierps.tiers._slot_index) ---------------------------- */
/* An open-addressing hash table in one int64 array of 2 * cap words (cap a power of two): entry i is
 * (table[2i] key, table[2i + 1] slot + 1), slot + 1 == 0 marking an empty entry; linear probing from
 * splitmix64(key). The caller keeps it at most half full, so every probe sequence ends at an empty entry. */
static int get_index(PyObject *obj, Buf *b, int writable, uint64_t *cap) {
    if (get_words(obj, b, writable, "index") < 0) return -1;
    uint64_t c = (uint64_t)NWORDS(*b) / 2;
    if (c < 2 || (c & (c - 1)) || (uint64_t)NWORDS(*b) != 2 * c) {
        PyErr_SetString(PyExc_ValueError, "index: expected 2 * cap int64 words, cap a power of two >= 2");
        release(b);
        return -1;
    }
    *cap = c;
    return 0;
}

/* slot_find(index, keys, slots, found) -> n: slots[i] the slot of keys[i] and found[i] 1, or 0 and 0
 * where the index lacks it; returns how many were found. */
static PyObject *py_slot_find(PyObject *self, PyObject *args) {
    PyObject *o_index, *o_keys, *o_slots, *o_found;
    if (!PyArg_ParseTuple(args, "OOOO", &o_index, &o_keys, &o_slots, &o_found)) return NULL;
    Buf index = {0}, keys = {0}, slots = {0}, found = {0};
    PyObject *result = NULL;
    uint64_t cap = 0;
    if (get_index(o_index, &index, 0, &cap) < 0 || get_words(o_keys, &keys, 0, "keys") < 0 ||
        get_words(o_slots, &slots, 1, "slots") < 0 || get_bytes(o_found, &found, 1, "found") < 0)
        goto done;
    Py_ssize_t n = NWORDS(keys);
    if (NWORDS(slots) != n || found.view.len != n) {
        PyErr_SetString(PyExc_ValueError, "slot_find: expected one slot and one bool per key");
        goto done;
    }
    const int64_t *t = WORDS(index), *k = WORDS(keys);
    int64_t *s = slots.view.buf;
    unsigned char *f = found.view.buf;
    const uint64_t mask = cap - 1;
    Py_ssize_t hits = 0;
    UNLOCK_IF(64 * n) uint64_t at[32];
    for (Py_ssize_t i = 0; i < n; i += 32) { /* in groups: first probes prefetched together */
        int m = n - i < 32 ? (int)(n - i) : 32;
        for (int j = 0; j < m; j++) {
            at[j] = splitmix64((uint64_t)k[i + j]) & mask;
            __builtin_prefetch(t + 2 * at[j], 0);
        }
        for (int j = 0; j < m; j++) {
            uint64_t e = at[j];
            int64_t key = k[i + j], slot = 0;
            while (t[2 * e + 1] != 0 && t[2 * e] != key) e = (e + 1) & mask;
            if (t[2 * e + 1] != 0) slot = t[2 * e + 1];
            s[i + j] = slot ? slot - 1 : 0;
            f[i + j] = slot != 0;
            hits += slot != 0;
        }
    }
    RELOCK result = PyLong_FromSsize_t(hits);
done:
    release(&index);
    release(&keys);
    release(&slots);
    release(&found);
    return result;
}

/* slot_put(index, used, keys, slots) -> n: keys[i] now at slots[i] (>= 0), added or moved, in an index
 * holding `used` entries; returns how many were added. The caller leaves room: the index stays at most
 * half full. */
static PyObject *py_slot_put(PyObject *self, PyObject *args) {
    PyObject *o_index, *o_keys, *o_slots;
    Py_ssize_t used;
    if (!PyArg_ParseTuple(args, "OnOO", &o_index, &used, &o_keys, &o_slots)) return NULL;
    Buf index = {0}, keys = {0}, slots = {0};
    PyObject *result = NULL;
    uint64_t cap = 0;
    if (get_index(o_index, &index, 1, &cap) < 0 || get_words(o_keys, &keys, 0, "keys") < 0 ||
        get_words(o_slots, &slots, 0, "slots") < 0)
        goto done;
    Py_ssize_t n = NWORDS(keys);
    if (NWORDS(slots) != n) {
        PyErr_SetString(PyExc_ValueError, "slot_put: expected one slot per key");
        goto done;
    }
    int64_t *t = index.view.buf;
    const int64_t *k = WORDS(keys), *s = WORDS(slots);
    const uint64_t mask = cap - 1;
    Py_ssize_t added = 0, bad = -1;
    UNLOCK_IF(64 * n) for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < 0 || used < 0 || (uint64_t)(used + 1) * 2 > cap) {
            bad = i;
            break;
        }
        uint64_t e = splitmix64((uint64_t)k[i]) & mask;
        while (t[2 * e + 1] != 0 && t[2 * e] != k[i]) e = (e + 1) & mask;
        if (t[2 * e + 1] == 0) {
            t[2 * e] = k[i];
            added++;
            used++;
        }
        t[2 * e + 1] = s[i] + 1;
    }
    RELOCK if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "slot_put: key %zd: %s", bad,
                     s[bad] < 0 ? "a slot is >= 0" : "the index would be more than half full");
        goto done;
    }
    result = PyLong_FromSsize_t(added);
done:
    release(&index);
    release(&keys);
    release(&slots);
    return result;
}

/* slot_drop(index, keys) -> n: keys no longer in the index (those absent ignored); returns how many
 * were removed. Linear probing without tombstones: each removal shifts back the entries after it whose
 * probe sequence passes through the freed entry, so every probe sequence still ends at an empty one. */
static PyObject *py_slot_drop(PyObject *self, PyObject *args) {
    PyObject *o_index, *o_keys;
    if (!PyArg_ParseTuple(args, "OO", &o_index, &o_keys)) return NULL;
    Buf index = {0}, keys = {0};
    PyObject *result = NULL;
    uint64_t cap = 0;
    if (get_index(o_index, &index, 1, &cap) < 0 || get_words(o_keys, &keys, 0, "keys") < 0) goto done;
    Py_ssize_t n = NWORDS(keys), removed = 0;
    int64_t *t = index.view.buf;
    const int64_t *k = WORDS(keys);
    const uint64_t mask = cap - 1;
    UNLOCK_IF(64 * n) for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t e = splitmix64((uint64_t)k[i]) & mask;
        while (t[2 * e + 1] != 0 && t[2 * e] != k[i]) e = (e + 1) & mask;
        if (t[2 * e + 1] == 0) continue;
        uint64_t hole = e, j = e;
        for (;;) {
            j = (j + 1) & mask;
            if (t[2 * j + 1] == 0) break;
            uint64_t home = splitmix64((uint64_t)t[2 * j]) & mask;
            /* the entry at j stays where its home lies cyclically in (hole, j] */
            int stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
            if (stays) continue;
            t[2 * hole] = t[2 * j];
            t[2 * hole + 1] = t[2 * j + 1];
            hole = j;
        }
        t[2 * hole] = 0;
        t[2 * hole + 1] = 0;
        removed++;
    }
    RELOCK result = PyLong_FromSsize_t(removed);
done:
    release(&index);
    release(&keys);
    return result;
}

/* -- matching a segment's rows to the keys asked (hierps.tiers._ssd) ------------------------- */
/* match_rows(block, width, keys, which, found, holder, seg, rows) -> n: `block` holds a segment's rows
 * read for a lookup, (k, 2 + width) float32, in key order, each row's key in its first 8 bytes; `keys` (n,)
 * int64 the sorted keys of the lookup and `which` (m,) int64 ascending the positions of those this segment
 * may hold. Where keys[which[j]] is in the block and found[which[j]] is still 0 (segments come newest
 * first, so an older copy is stale): found = 1, holder = seg, and, unless `rows` is None,
 * rows[which[j]] ((n, width) float32) = the block row's last `width` floats. Returns how many it found.
 * One merge walk over both sorted lists, where numpy takes hierps.rows._ids.find_sorted, a mask and two
 * gathers. */
static PyObject *py_match_rows(PyObject *self, PyObject *args) {
    PyObject *o_block, *o_keys, *o_which, *o_found, *o_holder, *o_rows;
    Py_ssize_t width;
    long long seg;
    if (!PyArg_ParseTuple(args, "OnOOOOLO", &o_block, &width, &o_keys, &o_which, &o_found, &o_holder, &seg,
                          &o_rows))
        return NULL;
    Buf block = {0}, keys = {0}, which = {0}, found = {0}, holder = {0}, rows = {0};
    PyObject *result = NULL;
    if (get_bytes(o_block, &block, 0, "block") < 0 || get_words(o_keys, &keys, 0, "keys") < 0 ||
        get_words(o_which, &which, 0, "which") < 0 || get_bytes(o_found, &found, 1, "found") < 0 ||
        get_words(o_holder, &holder, 1, "holder") < 0 ||
        (o_rows != Py_None && get_bytes(o_rows, &rows, 1, "rows") < 0))
        goto done;
    Py_ssize_t n = NWORDS(keys), m = NWORDS(which), stride = (width + 2) * 4;
    if (width < 0 || block.view.len % stride != 0) {
        PyErr_SetString(PyExc_ValueError, "match_rows: block rows are not 8 bytes of key + width float32");
        goto done;
    }
    if (found.view.len != n || NWORDS(holder) != n || (o_rows != Py_None && rows.view.len != n * width * 4)) {
        PyErr_SetString(PyExc_ValueError, "match_rows: expected one found flag, holder and row per key");
        goto done;
    }
    Py_ssize_t k = block.view.len / stride;
    const unsigned char *b = block.view.buf;
    const int64_t *key = WORDS(keys), *at = WORDS(which);
    unsigned char *f = found.view.buf;
    int64_t *h = holder.view.buf;
    unsigned char *out = o_rows != Py_None ? rows.view.buf : NULL;
    Py_ssize_t width_bytes = width * 4, hits = 0, bad = -1;
    /* A walk of tens of microseconds: the GIL is kept (released, it would wait for the read threads'
     * Python between their reads to have it back). */
    {
        for (Py_ssize_t j = 0; j < m && bad < 0; j++)  /* checked first: nothing is written then */
            if (at[j] < 0 || at[j] >= n) bad = j;
        Py_ssize_t i = 0;
        for (Py_ssize_t j = 0; j < m && i < k && bad < 0; j++) {
            Py_ssize_t q = at[j];
            int64_t want = key[q], have;
            memcpy(&have, b + i * stride, 8);
            while (have < want && ++i < k) memcpy(&have, b + i * stride, 8);
            if (i == k || have != want || f[q]) continue;
            f[q] = 1;
            h[q] = seg;
            if (out) memcpy(out + q * width_bytes, b + i * stride + 8, (size_t)width_bytes);
            hits++;
        }
    }
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "match_rows: which[%zd] is not a position among the %zd keys", bad, n);
        goto done;
    }
    result = PyLong_FromSsize_t(hits);
done:
    release(&block);
    release(&keys);
    release(&which);
    release(&found);
    release(&holder);
    release(&rows);
    return result;
}

/* -- distinct ids of a lookup (hierps.modules) ------------------------------------------------ */
typedef struct {
    int64_t key;
    int64_t first; /* its number in order of first sight */
} KeyFirst;

/* Sort a[0..n) by key (signed), through tmp (n entries): LSD radix sort by bytes, skipping a byte that all
 * keys share (the high bytes of small ids), so a few hundred ids take a few passes of a few hundred steps. */
static void sort_by_key(KeyFirst *a, KeyFirst *tmp, Py_ssize_t n) {
    KeyFirst *src = a, *dst = tmp;
    for (int shift = 0; shift < 64; shift += 8) {
        Py_ssize_t count[256] = {0};
        for (Py_ssize_t i = 0; i < n; i++) count[(((uint64_t)src[i].key ^ 0x8000000000000000ULL) >> shift) & 255]++;
        if (n == 0 || count[(((uint64_t)src[0].key ^ 0x8000000000000000ULL) >> shift) & 255] == n) continue;
        Py_ssize_t at = 0;
        for (int d = 0; d < 256; d++) {
            Py_ssize_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (Py_ssize_t i = 0; i < n; i++) dst[count[(((uint64_t)src[i].key ^ 0x8000000000000000ULL) >> shift) & 255]++] = src[i];
        KeyFirst *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(KeyFirst));
}

/* unique_ids(ids, keys, inverse, counts) -> u: torch.unique(ids, sorted=True, return_inverse=True,
 * return_counts=True) of ids (n,) int64 into the first u of keys (n,) and counts (n,) and all of
 * inverse (n,): a hash table finds each distinct id once, then only the distinct ones are sorted. */
static PyObject *py_unique_ids(PyObject *self, PyObject *args) {
    PyObject *o_ids, *o_keys, *o_inv, *o_counts;
    if (!PyArg_ParseTuple(args, "OOOO", &o_ids, &o_keys, &o_inv, &o_counts)) return NULL;
    Buf ids = {0}, keys = {0}, inv = {0}, counts = {0};
    PyObject *result = NULL;
    int64_t *table = NULL, *rank = NULL;
    KeyFirst *firsts = NULL;
    if (get_words(o_ids, &ids, 0, "ids") < 0 || get_words(o_keys, &keys, 1, "keys") < 0 ||
        get_words(o_inv, &inv, 1, "inverse") < 0 || get_words(o_counts, &counts, 1, "counts") < 0)
        goto done;
    Py_ssize_t n = NWORDS(ids);
    if (NWORDS(keys) != n || NWORDS(inv) != n || NWORDS(counts) != n) {
        PyErr_SetString(PyExc_ValueError, "unique_ids: expected keys, inverse and counts as long as ids");
        goto done;
    }
    uint64_t cap = 2;
    while (cap < 2 * (uint64_t)n) cap <<= 1;
    table = PyMem_Malloc(2 * cap * sizeof(int64_t)); /* (id, first + 1), first + 1 == 0: empty */
    firsts = PyMem_Malloc(2 * (size_t)(n ? n : 1) * sizeof(KeyFirst)); /* and the sort's second half */
    rank = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!table || !firsts || !rank) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *x = WORDS(ids);
    int64_t *k = keys.view.buf, *c = counts.view.buf, *v = inv.view.buf;
    const uint64_t mask = cap - 1;
    Py_ssize_t u = 0;
    UNLOCK_IF(48 * n) memset(table, 0, 2 * cap * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++) { /* v[i]: the id's number in order of first sight */
        uint64_t e = splitmix64((uint64_t)x[i]) & mask;
        while (table[2 * e + 1] != 0 && table[2 * e] != x[i]) e = (e + 1) & mask;
        if (table[2 * e + 1] == 0) {
            table[2 * e] = x[i];
            table[2 * e + 1] = u + 1;
            firsts[u].key = x[i];
            firsts[u].first = u;
            rank[u] = 0;
            u++;
        }
        v[i] = table[2 * e + 1] - 1;
        rank[v[i]]++; /* counts in order of first sight, for now */
    }
    sort_by_key(firsts, firsts + n, u);
    for (Py_ssize_t j = 0; j < u; j++) {
        k[j] = firsts[j].key;
        c[j] = rank[firsts[j].first];
    }
    for (Py_ssize_t j = 0; j < u; j++) rank[firsts[j].first] = j;
    for (Py_ssize_t i = 0; i < n; i++) v[i] = rank[v[i]];
    RELOCK result = PyLong_FromSsize_t(u);
done:
    PyMem_Free(table);
    PyMem_Free(firsts);
    PyMem_Free(rank);
    release(&ids);
    release(&keys);
    release(&inv);
    release(&counts);
    return result;
}

/* group_ids(ids, keep, at, search, local, order, where, counts) -> u: a mini-batch's ids of one table
 * grouped by key, for its plan (hierps.training._batchplan.translate). keep (K,) int64: the pass's keys,
 * strictly increasing, every id among them; at (n,) int64: each id's position in keep, given, or (search)
 * found here by binary search and written. Fills where[:u] (the positions in keep of the u distinct ids,
 * increasing), counts[:u] (their counts), local (n,) (each id's number among them) and order (n,) (the
 * ids' indices stably sorted by local: np.argsort(local, kind="stable")), by counting, in O(n + K). */
static PyObject *py_group_ids(PyObject *self, PyObject *args) {
    PyObject *o_ids, *o_keep, *o_at, *o_local, *o_order, *o_where, *o_counts;
    int search;
    if (!PyArg_ParseTuple(args, "OOOpOOOO", &o_ids, &o_keep, &o_at, &search, &o_local, &o_order, &o_where,
                          &o_counts))
        return NULL;
    Buf ids = {0}, keep = {0}, at = {0}, local = {0}, order = {0}, where = {0}, counts = {0};
    PyObject *result = NULL;
    int64_t *rank = NULL;
    if (get_words(o_ids, &ids, 0, "ids") < 0 || get_words(o_keep, &keep, 0, "keep") < 0 ||
        get_words(o_at, &at, search, "at") < 0 || get_words(o_local, &local, 1, "local") < 0 ||
        get_words(o_order, &order, 1, "order") < 0 || get_words(o_where, &where, 1, "where") < 0 ||
        get_words(o_counts, &counts, 1, "counts") < 0)
        goto done;
    Py_ssize_t n = NWORDS(ids), k = NWORDS(keep);
    if (NWORDS(at) != n || NWORDS(local) != n || NWORDS(order) != n || NWORDS(where) != n || NWORDS(counts) != n) {
        PyErr_SetString(PyExc_ValueError, "group_ids: expected at, local, order, where and counts as long as ids");
        goto done;
    }
    rank = PyMem_Calloc((size_t)(k ? k : 1), sizeof(int64_t));
    if (!rank) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *x = WORDS(ids), *kp = WORDS(keep);
    int64_t *a = at.view.buf, *loc = local.view.buf, *ord = order.view.buf, *w = where.view.buf,
            *c = counts.view.buf;
    Py_ssize_t bad = -1, u = 0;
    UNLOCK_IF(32 * n + 16 * k)
    for (Py_ssize_t i = 0; i < n && bad < 0; i++) {
        if (search) {
            Py_ssize_t lo = 0, hi = k;
            while (lo < hi) {
                Py_ssize_t mid = lo + (hi - lo) / 2;
                if (kp[mid] < x[i]) lo = mid + 1;
                else hi = mid;
            }
            a[i] = lo;
        }
        if (a[i] < 0 || a[i] >= k || kp[a[i]] != x[i]) bad = i;
        else rank[a[i]]++;
    }
    if (bad < 0) {
        for (Py_ssize_t j = 0; j < k; j++) { /* counts, then each used key's first place in order */
            if (rank[j]) {
                w[u] = j;
                c[u] = rank[j];
                rank[j] = u++;
            }
        }
        Py_ssize_t first = 0;
        for (Py_ssize_t j = 0; j < u; j++) { /* counts[j] becomes key j's first place in order */
            int64_t cj = c[j];
            c[j] = first;
            first += cj;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t l = rank[a[i]];
            loc[i] = l;
            ord[c[l]++] = i;
        }
        for (Py_ssize_t j = u - 1; j > 0; j--) c[j] -= c[j - 1]; /* each run's end, back to its count */
    }
    RELOCK if (bad >= 0) PyErr_Format(PyExc_ValueError,
                                      "group_ids: id %lld (index %zd) is not among the %zd keys given",
                                      (long long)x[bad], bad, k);
    else result = PyLong_FromSsize_t(u);
done:
    PyMem_Free(rank);
    release(&ids);
    release(&keep);
    release(&at);
    release(&local);
    release(&order);
    release(&where);
    release(&counts);
    return result;
}

/* -- merging sorted runs (hierps.storage._merge) ---------------------------------------------- */
/* merge_runs(keys, rows, ranks, newest_only, out_keys, out_rows, out_src) -> n: the entries of k parts
 * (keys[i] (n_i,) int64 strictly increasing, rows[i] (n_i, ...) rows of equal bytes, each row
 * contiguous, any row stride), in key order and, within a key, by rank descending; with newest_only
 * only the first (highest rank) entry of each key. Fills the first n entries of out_keys (N,),
 * out_rows (N rows, contiguous) and out_src (N,: the rank of each), N the parts' total. */
static PyObject *py_merge_runs(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_rows, *o_ranks, *o_ok, *o_orows, *o_osrc;
    int newest_only;
    if (!PyArg_ParseTuple(args, "O!O!OpOOO", &PyList_Type, &o_keys, &PyList_Type, &o_rows, &o_ranks, &newest_only,
                          &o_ok, &o_orows, &o_osrc))
        return NULL;
    Py_ssize_t k = PyList_GET_SIZE(o_keys);
    if (PyList_GET_SIZE(o_rows) != k || k < 1 || k > 4096) {
        PyErr_SetString(PyExc_ValueError, "merge_runs: expected 1 to 4096 parts, as many keys as rows");
        return NULL;
    }
    Buf *bufs = PyMem_Calloc((size_t)(2 * k), sizeof(Buf));
    Py_ssize_t *head = PyMem_Calloc((size_t)k, sizeof(Py_ssize_t));
    Buf ranks = {0}, ok = {0}, orows = {0}, osrc = {0};
    PyObject *result = NULL;
    if (!bufs || !head) {
        PyErr_NoMemory();
        goto done;
    }
    if (get_words(o_ranks, &ranks, 0, "ranks") < 0 || get_words(o_ok, &ok, 1, "out_keys") < 0 ||
        get_bytes(o_orows, &orows, 1, "out_rows") < 0 || get_words(o_osrc, &osrc, 1, "out_src") < 0)
        goto done;
    Py_ssize_t total = 0, row_bytes = -1;
    for (Py_ssize_t i = 0; i < k; i++) {
        Buf *kb = &bufs[2 * i], *rb = &bufs[2 * i + 1];
        if (get_words(PyList_GET_ITEM(o_keys, i), kb, 0, "keys") < 0) goto done;
        if (PyObject_GetBuffer(PyList_GET_ITEM(o_rows, i), &rb->view, PyBUF_STRIDES) < 0) goto done;
        rb->held = 1;
        Py_buffer *v = &rb->view;
        Py_ssize_t n = NWORDS(*kb), rb_bytes = v->ndim >= 1 && v->shape[0] ? v->len / v->shape[0] : 0;
        int row_contiguous = v->ndim == 1 ? v->strides[0] == v->itemsize : 1;
        for (int d = v->ndim - 1, step = (int)v->itemsize; d >= 1; d--) {
            if (v->shape[d] > 1 && v->strides[d] != step) row_contiguous = 0;
            step *= (int)v->shape[d];
        }
        if (v->ndim < 1 || v->shape[0] != n || !row_contiguous || (n && v->strides[0] < rb_bytes) ||
            (n && row_bytes >= 0 && rb_bytes != row_bytes)) {
            PyErr_Format(PyExc_ValueError, "merge_runs: part %zd's rows do not match its keys or the others", i);
            goto done;
        }
        if (n) row_bytes = rb_bytes;
        total += n;
    }
    if (row_bytes < 0) row_bytes = 0;
    if (NWORDS(ranks) != k || NWORDS(ok) != total || NWORDS(osrc) != total || orows.view.len != total * row_bytes) {
        PyErr_SetString(PyExc_ValueError, "merge_runs: expected one rank a part and outputs of every entry");
        goto done;
    }
    const int64_t *rk = WORDS(ranks);
    int64_t *out_k = (int64_t *)ok.view.buf, *out_s = (int64_t *)osrc.view.buf;
    unsigned char *out_r = orows.view.buf;
    Py_ssize_t n_out = 0;
    UNLOCK_IF(total * (row_bytes + 16)) for (;;) {
        Py_ssize_t best = -1;
        int64_t key = 0;
        for (Py_ssize_t i = 0; i < k; i++) {
            if (head[i] >= NWORDS(bufs[2 * i])) continue;
            int64_t ki = WORDS(bufs[2 * i])[head[i]];
            if (best < 0 || ki < key || (ki == key && rk[i] > rk[best])) {
                best = i;
                key = ki;
            }
        }
        if (best < 0) break;
        Py_buffer *v = &bufs[2 * best + 1].view;
        out_k[n_out] = key;
        out_s[n_out] = rk[best];
        memcpy(out_r + n_out * row_bytes, (const char *)v->buf + head[best] * v->strides[0], (size_t)row_bytes);
        n_out++;
        head[best]++;
        if (newest_only)
            for (Py_ssize_t i = 0; i < k; i++)
                if (head[i] < NWORDS(bufs[2 * i]) && WORDS(bufs[2 * i])[head[i]] == key) head[i]++;
    }
    RELOCK result = PyLong_FromSsize_t(n_out);
done:
    if (bufs)
        for (Py_ssize_t i = 0; i < 2 * k; i++) release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(head);
    release(&ranks);
    release(&ok);
    release(&orows);
    release(&osrc);
    return result;
}

/* -- module ----------------------------------------------------------------------------------- */
static PyObject *py_hardware(PyObject *self, PyObject *unused) { return PyBool_FromLong(have_hw); }

static PyObject *py_set_hardware(PyObject *self, PyObject *arg) {
    int want = PyObject_IsTrue(arg);
    if (want < 0) return NULL;
    int prev = have_hw;
#ifdef HIERPS_X86
    have_hw = want && __builtin_cpu_supports("sse4.2");
#else
    have_hw = 0;
#endif
    return PyBool_FromLong(prev);
}

/* The first position in sorted[from:n] whose key is not below `key` (n if none), where every key
 * before `from` is below it: galloping from `from` by steps that double, then halving, so that keys
 * asked in ascending order cost O(log(distance)) each. */
static Py_ssize_t gallop_lower(const int64_t *sorted, Py_ssize_t n, Py_ssize_t from, int64_t key) {
    Py_ssize_t lo = from, step = 1;
    while (lo + step <= n && sorted[lo + step - 1] < key) { /* skip runs of keys < key, doubling */
        lo += step;
        step <<= 1;
    }
    Py_ssize_t hi = lo + step - 1 < n ? lo + step - 1 : n; /* the answer is in [lo, hi] */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* insert_sorted(keys, slots, new_keys, new_slots, out_keys, out_slots): the RAM tier's sorted index
 * (hierps.tiers._memory) with keys added: keys (n,) int64 ascending and their slots (n,), new_keys (m,)
 * int64 ascending (none among keys) and theirs (m,), into out_keys and out_slots (n + m,) each, ascending:
 * each new key placed before the first key not below it (np.insert at np.searchsorted, side left). The
 * keys between two new ones are copied as one run, found by galloping from the last: O(n + m log(n / m)),
 * at memory speed where np.insert builds a mask of n + m entries and scatters through it. */
static PyObject *py_insert_sorted(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_slots, *o_nk, *o_ns, *o_ok, *o_os;
    if (!PyArg_ParseTuple(args, "OOOOOO", &o_keys, &o_slots, &o_nk, &o_ns, &o_ok, &o_os)) return NULL;
    Buf keys = {0}, slots = {0}, nk = {0}, ns = {0}, ok = {0}, os_ = {0};
    PyObject *result = NULL;
    if (get_words(o_keys, &keys, 0, "keys") < 0 || get_words(o_slots, &slots, 0, "slots") < 0 ||
        get_words(o_nk, &nk, 0, "new_keys") < 0 || get_words(o_ns, &ns, 0, "new_slots") < 0 ||
        get_words(o_ok, &ok, 1, "out_keys") < 0 || get_words(o_os, &os_, 1, "out_slots") < 0)
        goto done;
    Py_ssize_t n = NWORDS(keys), m = NWORDS(nk);
    if (NWORDS(slots) != n || NWORDS(ns) != m || NWORDS(ok) != n + m || NWORDS(os_) != n + m) {
        PyErr_SetString(PyExc_ValueError,
                        "insert_sorted: expected a slot per key and per new key, and n + m entries out");
        goto done;
    }
    const int64_t *k = WORDS(keys), *s = WORDS(slots), *a = WORDS(nk), *b = WORDS(ns);
    int64_t *outk = ok.view.buf, *outs = os_.view.buf;
    UNLOCK_IF(16 * (n + m)) Py_ssize_t i = 0, o = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_ssize_t lo = gallop_lower(k, n, i, a[j]); /* the held keys below a[j] from i: one run */
        memcpy(outk + o, k + i, (size_t)(lo - i) * sizeof(int64_t));
        memcpy(outs + o, s + i, (size_t)(lo - i) * sizeof(int64_t));
        o += lo - i;
        i = lo;
        outk[o] = a[j];
        outs[o++] = b[j];
    }
    memcpy(outk + o, k + i, (size_t)(n - i) * sizeof(int64_t));
    memcpy(outs + o, s + i, (size_t)(n - i) * sizeof(int64_t));
    RELOCK result = Py_NewRef(Py_None);
done:
    release(&keys);
    release(&slots);
    release(&nk);
    release(&ns);
    release(&ok);
    release(&os_);
    return result;
}

/* find_sorted(sorted_keys, keys, found, at) -> hits: where each of keys (m,) int64 stands in sorted_keys
 * (n,) int64 ascending: at[i] = the first position whose key is >= keys[i] (numpy's searchsorted, side
 * left), clamped to n - 1 (0 when n == 0), found[i] = sorted_keys[at[i]] == keys[i]. Keys in ascending
 * order (a mini-batch's, a lookup's) are searched from where the one before stopped, by steps that
 * double, then halve: O(m log(n / m)) where a search each costs O(m log n). */
static PyObject *py_find_sorted(PyObject *self, PyObject *args) {
    PyObject *o_sorted, *o_keys, *o_found, *o_at;
    if (!PyArg_ParseTuple(args, "OOOO", &o_sorted, &o_keys, &o_found, &o_at)) return NULL;
    Buf sorted = {0}, keys = {0}, found = {0}, at = {0};
    PyObject *result = NULL;
    if (get_words(o_sorted, &sorted, 0, "sorted_keys") < 0 || get_words(o_keys, &keys, 0, "keys") < 0 ||
        get_bytes(o_found, &found, 1, "found") < 0 || get_words(o_at, &at, 1, "at") < 0)
        goto done;
    Py_ssize_t n = NWORDS(sorted), m = NWORDS(keys);
    if (NWORDS(at) != m || found.view.len != m) {
        PyErr_SetString(PyExc_ValueError, "find_sorted: expected one position and one bool per key");
        goto done;
    }
    const int64_t *s = WORDS(sorted), *k = WORDS(keys);
    int64_t *a = at.view.buf;
    unsigned char *f = found.view.buf;
    Py_ssize_t hits = 0;
    UNLOCK_IF(8 * m) Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t key = k[i];
        /* from where the key before stopped, when it is not above this one */
        pos = gallop_lower(s, n, (i > 0 && key >= k[i - 1]) ? pos : 0, key);
        Py_ssize_t c = n == 0 ? 0 : (pos < n ? pos : n - 1);
        a[i] = c;
        f[i] = n > 0 && s[c] == key;
        hits += f[i];
    }
    RELOCK result = PyLong_FromSsize_t(hits);
done:
    release(&sorted);
    release(&keys);
    release(&found);
    release(&at);
    return result;
}

/* -- summing gradient rows (hierps.training._batchplan) ---------------------------------------- */
/* index_add_rows(dst, rows, src, width): dst[rows[i]] += src[i] for i in order, rows of `width` float32:
 * the floats of torch's index_add_ on the CPU (one add an element, the entries in order), without its
 * dispatch per entry. dst (U * width,) and src (n * width,) float32 contiguous, rows (n,) int64 each in
 * [0, U), all checked before dst changes (IndexError: nothing added). */
static PyObject *py_index_add_rows(PyObject *self, PyObject *args) {
    PyObject *o_dst, *o_rows, *o_src;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OOOn", &o_dst, &o_rows, &o_src, &width)) return NULL;
    Buf dst = {0}, rows = {0}, src = {0};
    PyObject *result = NULL;
    if (get_bytes(o_dst, &dst, 1, "dst") < 0 || get_words(o_rows, &rows, 0, "rows") < 0 ||
        get_bytes(o_src, &src, 0, "src") < 0)
        goto done;
    Py_ssize_t n = NWORDS(rows);
    if (width <= 0 || dst.view.len % (4 * width) || src.view.len != n * 4 * width) {
        PyErr_SetString(PyExc_ValueError, "index_add_rows: expected (U, width) and (n, width) float32 rows for n rows");
        goto done;
    }
    const Py_ssize_t u = dst.view.len / (4 * width);
    const int64_t *r = WORDS(rows);
    for (Py_ssize_t i = 0; i < n; i++)
        if (r[i] < 0 || r[i] >= u) {
            PyErr_Format(PyExc_IndexError, "index_add_rows: row %lld of entry %zd is out of range for %zd rows",
                         (long long)r[i], i, u);
            goto done;
        }
    float *d = dst.view.buf;
    const float *v = src.view.buf;
    UNLOCK_IF(8 * width * n) for (Py_ssize_t i = 0; i < n; i++) {
        float *row = d + r[i] * width;
        const float *add = v + i * width;
        for (Py_ssize_t j = 0; j < width; j++) row[j] += add[j];
    }
    RELOCK Py_INCREF(Py_None);
    result = Py_None;
done:
    release(&dst);
    release(&rows);
    release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, value=0) -> int: the crc32c of data, continuing value."},
    {"check_gather", (PyCFunction)(void (*)(void))py_check_gather, METH_VARARGS | METH_KEYWORDS,
     "Check chunks (crc32c, binding tag) and copy rows out of them; see _core.pyi."},
    {"plan_chunks", py_plan_chunks, METH_VARARGS, "The chunks holding rows, and how the rows lie; see _core.pyi."},
    {"plan_runs", py_plan_runs, METH_VARARGS, "Cut a request's chunks into runs of one pread; see _core.pyi."},
    {"read_check_gather", py_read_check_gather, METH_VARARGS,
     "Read runs into a scratch buffer, then check their chunks and gather their rows; see _core.pyi."},
    {"bloom_add", py_bloom_add, METH_VARARGS, "bloom_add(filter, keys): set the keys' bits in a one-block filter."},
    {"bloom_may_contain", py_bloom_may_contain, METH_VARARGS,
     "bloom_may_contain(filter, keys, block, full_words, out): False where the filter proves a key absent."},
    {"slot_find", py_slot_find, METH_VARARGS, "slot_find(index, keys, slots, found) -> n: look keys up; see _core.pyi."},
    {"slot_put", py_slot_put, METH_VARARGS, "slot_put(index, used, keys, slots) -> n: add or move keys; see _core.pyi."},
    {"slot_drop", py_slot_drop, METH_VARARGS, "slot_drop(index, keys) -> n: remove keys; see _core.pyi."},
    {"match_rows", py_match_rows, METH_VARARGS,
     "match_rows(block, width, keys, which, found, holder, seg, rows) -> n: a segment's rows to the keys asked; see _core.pyi."},
    {"insert_sorted", py_insert_sorted, METH_VARARGS,
     "insert_sorted(keys, slots, new_keys, new_slots, out_keys, out_slots): sorted keys added; see _core.pyi."},
    {"find_sorted", py_find_sorted, METH_VARARGS,
     "find_sorted(sorted_keys, keys, found, at) -> hits: where keys stand in sorted keys; see _core.pyi."},
    {"unique_ids", py_unique_ids, METH_VARARGS, "unique_ids(ids, keys, inverse, counts) -> u: see _core.pyi."},
    {"group_ids", py_group_ids, METH_VARARGS,
     "group_ids(ids, keep, at, search, local, order, where, counts) -> u: see _core.pyi."},
    {"index_add_rows", py_index_add_rows, METH_VARARGS,
     "index_add_rows(dst, rows, src, width): dst[rows[i]] += src[i], in order; see _core.pyi."},
    {"merge_runs", py_merge_runs, METH_VARARGS, "Merge sorted parts by key, then rank descending; see _core.pyi."},
    {"encode_chunks", py_encode_chunks, METH_VARARGS,
     "encode_chunks(rows, chunk_rows, first, seed, stride, out, content) -> int: chunks with crc32c and binding tag."},
    {"binding_tags", py_binding_tags, METH_VARARGS, "binding_tags(chunks, crcs, seed, out)."},
    {"hardware", py_hardware, METH_NOARGS, "Whether crc32c runs on the CPU's crc32 instruction."},
    {"set_hardware", py_set_hardware, METH_O,
     "Use the CPU's crc32 instruction (when it has one) or the table; returns the previous setting."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_core", "hierps' compiled loops over bytes.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__core(void) {
    init_tables();
#ifdef HIERPS_X86
    __builtin_cpu_init();
    have_hw = __builtin_cpu_supports("sse4.2");
    zeros_tables(zeros_long, LONG_BLOCK);
    zeros_tables(zeros_short, SHORT_BLOCK);
#endif
    return PyModule_Create(&module);
}
