/* _kernels: per-token loops of the metric engine, one pass where numpy makes many.
 *
 *   curves      the log-ratio histogram, the 2-D probability histogram and the crossed
 *               (position, probability) table with its four sums (``curves.token_tables``);
 *   thresholds  counts of an array above and below thresholds, and its extremes
 *               (``accum.thresholds``);
 *   is_stats    an importance-sampling spec's weights and their sums, per batch and per
 *               sequence (``weights.is_stats``);
 *   integrity   the integrity checks' counts, extremes and L(k) sums of a batch, and the
 *               values the sampling checks go on with (``integrity.IntegrityAccumulator``).
 *
 * Each function takes the batch's arrays (anything with the buffer protocol: C-contiguous
 * numpy arrays of the dtype named) and adds into output arrays it is handed (``integrity``
 * fills them: the caller adds them to its state), so Python keeps the state. Each gives the bits of the numpy calls it replaces (the callers keep those calls,
 * for a build without a C compiler, and ``tests/test_metrics_compiled.py`` compares the two,
 * down to the whole engine's output):
 *
 *   - a bin is found by comparisons with the bounds numpy's code compares with (computed as
 *     ``np.linspace`` computes them, or looked up), from a guess made with the same arithmetic
 *     (compiled with ``-ffp-contract=off``: no fused multiply-add);
 *   - a bin's sum adds its values in row order, one IEEE addition at a time, as
 *     ``np.bincount(idx, weights=w)`` does; counts are integers;
 *   - a sum over rows follows numpy's pairwise summation tree (``pairwise``), so ``x.sum()``
 *     and ``np.add.reduceat`` give the same bits;
 *   - a value compared with a threshold is the value numpy compares (``|x - c|`` by the same
 *     two IEEE operations), and a largest or smallest value is the same whatever the order
 *     (but for the sign of a zero where both signs occur: every caller's values are >= +0).
 *
 * ``-fno-trapping-math`` lets the compiler compute both sides of a select of floats (nothing
 * here reads the floating-point exception flags), so those loops vectorise; the hot loops are
 * built for AVX-512, AVX2 and the baseline, the one the processor runs chosen at load time
 * (``target_clones``): each computes the same IEEE operations in the same order.
 *
 * The interpreter lock is released during each loop, so batches compute on every core.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Eight lanes of doubles or of int64 (GCC's vector extensions: one AVX-512 register, two AVX2
 * ones, four SSE2 ones, whichever the function's target has). A compare gives -1 (all bits)
 * where it holds. Used where the compiler does not vectorise a running maximum by itself. */
#pragma GCC diagnostic ignored "-Wpsabi" /* the helpers below are static: no ABI to keep */
typedef double v8d __attribute__((vector_size(64)));
typedef int64_t v8l __attribute__((vector_size(64)));

static inline v8d load8(const double *p)
{
    v8d v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* where mask: a, else b */
static inline v8d select8(v8l mask, v8d a, v8d b) { return (v8d)(((v8l)a & mask) | ((v8l)b & ~mask)); }

/* Each hot loop compiled for AVX-512, AVX2 and the baseline, the one the processor runs chosen
 * when the module loads (GCC's function multi-versioning: x86-64 and an ELF loader's ifunc);
 * elsewhere compiled once, for the target the compiler is given. */
#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES_AVX512F __attribute__((target_clones("avx512f", "avx2", "default")))
#define CLONES_X86_64_V4 __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define CLONES_AVX512F
#define CLONES_X86_64_V4
#endif

/* Release each of the n views that was taken (its ``obj`` set). */
static void release(Py_buffer *const *views, int n)
{
    for (int k = 0; k < n; k++)
        if (views[k]->obj)
            PyBuffer_Release(views[k]);
}

/* A read buffer of ``n`` items of ``size`` bytes (n < 0: any length, set from the buffer). */
static int take(Py_buffer *view, Py_ssize_t *n, Py_ssize_t size, const char *what)
{
    if (view->len % size != 0 || (*n >= 0 && view->len / size != *n)) {
        PyErr_Format(PyExc_ValueError, "_kernels: %s holds %zd bytes, not %zd items of %zd",
                     what, view->len, *n, size);
        return -1;
    }
    *n = view->len / size;
    return 0;
}

enum { NSUMS = 4, CB = 1024 };

/* The bins of one batch (see ``curves``). */
typedef struct {
    double hscale, hoffset, htop; /* the histogram's guess: clip(r * hscale + hoffset, 0, htop) */
    const double *hbounds;        /* its bins + 4 slot bounds */
    double hlo, hstep;            /* bound k = (k - 1) * hstep + hlo for k = 1 .. bins */
    int32_t hbins, computed;      /* computed: those bounds equal hbounds (no table look-up) */
    const int64_t *pos_edges;     /* npos - 1 inner position edges, ascending */
    const double *prob_edges;     /* nprob - 1 inner probability edges, ascending */
    int32_t npos, nprob, nb2;
    Py_ssize_t ncell;
} Bins;

/* The bins of rows 0 .. m - 1 of a block, each loop plain arithmetic and compares the
 * compiler vectorises (no table look-up where ``computed``):
 *   slot: the histogram's slot of r, guessed and corrected by one bound each way, the bounds
 *         computed as ``np.linspace`` computes its edges (k - 1 times the step, plus the low
 *         end; no fused multiply-add), or looked up;
 *   cell2: the 2-D histogram's cell;
 *   cell: the crossed (position, rollout probability) cell, each bin the number of inner edges
 *         at or below the value (``searchsorted(edges, v, "right") - 1``, clipped). */
CLONES_X86_64_V4
static void block_bins(Py_ssize_t m, const double *restrict r, const double *restrict pr,
                       const double *restrict ptr, const int64_t *restrict pos, const Bins *bins,
                       int32_t *restrict slot, int32_t *restrict cell2, int32_t *restrict cell)
{
    const Bins z = *bins;
    const double top2 = (double)(z.nb2 - 1), nb2 = (double)z.nb2;
    const double *restrict hb = z.hbounds;
    const double hnext = hb[z.hbins + 1]; /* above the last edge: nextafter(hi), then inf */
    const int32_t nbins = z.hbins;
    if (z.computed) {
        for (Py_ssize_t i = 0; i < m; i++) {
            const double x = r[i];
            double g = x * z.hscale + z.hoffset;
            g = g > 0.0 ? g : 0.0;
            g = g < z.htop ? g : z.htop;
            const int32_t k = (int32_t)g; /* 0 .. bins + 1 */
            const double lo_edge = (double)(k - 1) * z.hstep + z.hlo;
            const double hi_edge = (double)k * z.hstep + z.hlo;
            const double below = k == 0 ? -INFINITY : (k <= nbins ? lo_edge : hnext);
            const double above = k < nbins ? hi_edge : (k == nbins ? hnext : INFINITY);
            slot[i] = k - (x < below) + (x >= above);
        }
    } else {
        for (Py_ssize_t i = 0; i < m; i++) {
            const double x = r[i];
            double g = x * z.hscale + z.hoffset;
            g = g > 0.0 ? g : 0.0;
            g = g < z.htop ? g : z.htop;
            int32_t k = (int32_t)g;
            k -= x < hb[k];
            k += x >= hb[k + 1];
            slot[i] = k;
        }
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        double gx = pr[i] * nb2, gy = ptr[i] * nb2;
        gx = gx > 0.0 ? (gx < top2 ? gx : top2) : 0.0;
        gy = gy > 0.0 ? (gy < top2 ? gy : top2) : 0.0;
        cell2[i] = (int32_t)gx * z.nb2 + (int32_t)gy;
    }
    int32_t qbin[CB];
    for (Py_ssize_t i = 0; i < m; i++)
        cell[i] = 0, qbin[i] = 0;
    for (int32_t e = 0; e < z.nprob - 1; e++) {
        const double t = z.prob_edges[e];
        for (Py_ssize_t i = 0; i < m; i++)
            cell[i] += pr[i] >= t;
    }
    for (int32_t e = 0; e < z.npos - 1; e++) {
        const int64_t t = z.pos_edges[e];
        for (Py_ssize_t i = 0; i < m; i++)
            qbin[i] += pos[i] >= t;
    }
    for (Py_ssize_t i = 0; i < m; i++)
        cell[i] += qbin[i] * z.nprob;
}

static void curves_loop(Py_ssize_t n, const double *restrict r, const double *restrict abs_r,
                        const double *restrict k3, const double *restrict dp,
                        const double *restrict pr, const double *restrict ptr,
                        const int64_t *restrict pos, const Bins *bins, int64_t *restrict hist,
                        int64_t *restrict hist2d, int64_t *restrict count,
                        double *restrict sums)
{
    const Py_ssize_t nc = bins->ncell;
    double *restrict s0 = sums, *restrict s1 = sums + nc, *restrict s2 = sums + 2 * nc,
                     *restrict s3 = sums + 3 * nc;
    /* A block's bins first, then its additions: the tables' addresses are known before the
     * adds, so a run of rows in one bin (most rows of one sequence) is a chain of additions,
     * not a stall on each address. The adds keep their row order. */
    int32_t slot[CB], cell2[CB], cell[CB];
    for (Py_ssize_t start = 0; start < n; start += CB) {
        const Py_ssize_t m = n - start < CB ? n - start : CB;
        block_bins(m, r + start, pr + start, ptr + start, pos + start, bins, slot, cell2, cell);
        for (Py_ssize_t j = 0; j < m; j++) {
            hist[slot[j]] += 1;
            hist2d[cell2[j]] += 1;
            count[cell[j]] += 1;
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            const Py_ssize_t i = start + j, c = cell[j];
            s0[c] += r[i];
            s1[c] += abs_r[i];
            s2[c] += k3[i];
            s3[c] += dp[i];
        }
    }
}

/* curves(r, abs_r, k3, dp, p_rollout, p_train, position,
 *        hist_bounds, hist_scale, hist_offset, hist_lo, hist_step, pos_edges, prob_edges,
 *        hist2d_bins, hist, hist2d, cell_count, cell_sums)
 *
 * For the N valid tokens (float64 arrays; position int64), adds:
 *   hist[s]        += 1, s = uniform_hist's slot of r (hist_bounds: its bounds, bins + 4 of
 *                    them, the inner ones hist_lo + (k - 1) * hist_step as linspace computes
 *                    them; guess r * hist_scale + hist_offset clipped to [0, bins + 1]);
 *   hist2d[i * B + j] += 1, i, j = min(floor(clip(p * B, 0, B - 1))) of p_rollout, p_train;
 *   cell_count[c]  += 1 and cell_sums[k * C + c] += (r, abs_r, k3, dp)[k], c = position bin *
 *                    P + probability bin (pos_edges, int64, and prob_edges, float64: the inner
 *                    edges of each, ascending; a bin is the number of them at or below the
 *                    value; P = len(prob_edges) + 1 bins, C cells). */
static PyObject *curves(PyObject *self, PyObject *args)
{
    Py_buffer in[7], hb, pe, qe, out[4];
    double hscale, hoffset, hlo, hstep;
    Py_ssize_t nb2;
    for (int k = 0; k < 7; k++)
        in[k].obj = NULL;
    hb.obj = pe.obj = qe.obj = NULL;
    for (int k = 0; k < 4; k++)
        out[k].obj = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*ddddy*y*nw*w*w*w*", &in[0], &in[1], &in[2],
                          &in[3], &in[4], &in[5], &in[6], &hb, &hscale, &hoffset, &hlo, &hstep,
                          &pe, &qe, &nb2, &out[0], &out[1], &out[2], &out[3]))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = -1, nhb = -1, npe = -1, nqe = -1, nh = -1, n2 = -1, nc = -1, ns = -1;
    const char *names[7] = {"r", "abs_r", "k3", "dp", "p_rollout", "p_train", "position"};
    for (int k = 0; k < 7; k++)
        if (take(&in[k], &n, 8, names[k]) < 0)
            goto done;
    if (take(&hb, &nhb, 8, "hist_bounds") < 0 || take(&pe, &npe, 8, "pos_edges") < 0 ||
        take(&qe, &nqe, 8, "prob_edges") < 0 || take(&out[0], &nh, 8, "hist") < 0 ||
        take(&out[1], &n2, 8, "hist2d") < 0 || take(&out[2], &nc, 8, "cell_count") < 0 ||
        take(&out[3], &ns, 8, "cell_sums") < 0)
        goto done;
    const Py_ssize_t nprob = nqe + 1, npos = npe + 1, nbins = nhb - 4;
    if (nbins < 1 || nbins > INT32_MAX / 2 || nh != nbins + 3 || nb2 < 1 || nb2 > 46340 ||
        n2 != nb2 * nb2 || nc != npos * nprob || nc > INT32_MAX || ns != NSUMS * nc) {
        PyErr_SetString(PyExc_ValueError, "_kernels.curves: output sizes do not match the bins");
        goto done;
    }
    Bins bins = {.hscale = hscale, .hoffset = hoffset, .htop = (double)(nbins + 1),
                 .hbounds = hb.buf, .hlo = hlo, .hstep = hstep, .hbins = (int32_t)nbins,
                 .computed = 1, .pos_edges = pe.buf, .prob_edges = qe.buf,
                 .npos = (int32_t)npos, .nprob = (int32_t)nprob, .nb2 = (int32_t)nb2,
                 .ncell = nc};
    const double *bounds = hb.buf; /* computed where they are the bounds handed, else looked up */
    bins.computed = bounds[0] == -INFINITY && bounds[nbins + 2] == INFINITY;
    for (int32_t k = 1; k <= nbins && bins.computed; k++)
        bins.computed = (double)(k - 1) * hstep + hlo == bounds[k];
    Py_BEGIN_ALLOW_THREADS
    curves_loop(n, in[0].buf, in[1].buf, in[2].buf, in[3].buf, in[4].buf, in[5].buf, in[6].buf,
                &bins, out[0].buf, out[1].buf, out[2].buf, out[3].buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:;
    Py_buffer *all[14] = {&in[0], &in[1], &in[2], &in[3],  &in[4],  &in[5],  &in[6],
                          &hb,    &pe,    &qe,    &out[0], &out[1], &out[2], &out[3]};
    release(all, 14);
    return result;
}

/* The counts and extremes of one array (see ``thresholds``), a block of rows at a time: each
 * threshold's count is one vectorisable loop over a block held in the first-level cache. */
enum { BLOCK = 2048 };

CLONES_AVX512F
static void thresholds_loop(Py_ssize_t n, const double *restrict x, double center,
                            const double *restrict above, Py_ssize_t na,
                            const double *restrict below, Py_ssize_t nb, int64_t *restrict n_above,
                            int64_t *restrict n_below, double *hi, double *lo)
{
    /* eight lanes per extreme and count: each lane's compares are in row order, the lanes
     * combined at the end (the extremes do not depend on the order) */
    double buf[BLOCK], top[8], bottom[8];
    for (int l = 0; l < 8; l++)
        top[l] = -INFINITY, bottom[l] = INFINITY;
    const int centered = !isnan(center);
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t m = n - start < BLOCK ? n - start : BLOCK;
        const Py_ssize_t m8 = m - m % 8;
        const double *v = x + start; /* the values themselves, or |x - center| computed */
        if (centered) {
            for (Py_ssize_t i = 0; i < m; i++)
                buf[i] = fabs(x[start + i] - center);
            v = buf;
        }
        v8d hi8 = load8(top), lo8 = load8(bottom);
        for (Py_ssize_t i = 0; i < m8; i += 8) {
            const v8d x8 = load8(v + i);
            hi8 = select8(x8 > hi8, x8, hi8);
            lo8 = select8(x8 < lo8, x8, lo8);
        }
        memcpy(top, &hi8, sizeof hi8);
        memcpy(bottom, &lo8, sizeof lo8);
        for (Py_ssize_t i = m8; i < m; i++) {
            top[0] = v[i] > top[0] ? v[i] : top[0];
            bottom[0] = v[i] < bottom[0] ? v[i] : bottom[0];
        }
        for (Py_ssize_t k = 0; k < na; k++) {
            v8l c8 = {0};
            for (Py_ssize_t i = 0; i < m8; i += 8)
                c8 -= load8(v + i) > above[k]; /* a true compare is -1 */
            int64_t c = 0;
            for (Py_ssize_t i = m8; i < m; i++)
                c += v[i] > above[k];
            n_above[k] += c + c8[0] + c8[1] + c8[2] + c8[3] + c8[4] + c8[5] + c8[6] + c8[7];
        }
        for (Py_ssize_t k = 0; k < nb; k++) {
            v8l c8 = {0};
            for (Py_ssize_t i = 0; i < m8; i += 8)
                c8 -= load8(v + i) < below[k];
            int64_t c = 0;
            for (Py_ssize_t i = m8; i < m; i++)
                c += v[i] < below[k];
            n_below[k] += c + c8[0] + c8[1] + c8[2] + c8[3] + c8[4] + c8[5] + c8[6] + c8[7];
        }
    }
    *hi = top[0], *lo = bottom[0];
    for (int l = 1; l < 8; l++) {
        *hi = top[l] > *hi ? top[l] : *hi;
        *lo = bottom[l] < *lo ? bottom[l] : *lo;
    }
}

/* thresholds(x, center, above, below, n_above, n_below) -> (max, min)
 *
 * For the values v = x (center NaN) or v = |x - center| of the float64 array x (no NaN):
 * n_above[k] += count(v > above[k]), n_below[k] += count(v < below[k]) (int64 outputs, one per
 * threshold), and the largest and smallest v (-inf and inf for no value): the counts of
 * ``np.count_nonzero(v > t)`` and ``v.max()``, ``v.min()``, in one pass. */
static PyObject *thresholds(PyObject *self, PyObject *args)
{
    Py_buffer x, ab, be, na, nb;
    double center, hi = -INFINITY, lo = INFINITY;
    x.obj = ab.obj = be.obj = na.obj = nb.obj = NULL;
    if (!PyArg_ParseTuple(args, "y*dy*y*w*w*", &x, &center, &ab, &be, &na, &nb))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = -1, nab = -1, nbe = -1;
    if (take(&x, &n, 8, "x") < 0 || take(&ab, &nab, 8, "above") < 0 ||
        take(&be, &nbe, 8, "below") < 0 || take(&na, &nab, 8, "n_above") < 0 ||
        take(&nb, &nbe, 8, "n_below") < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    thresholds_loop(n, x.buf, center, ab.buf, nab, be.buf, nbe, na.buf, nb.buf, &hi, &lo);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("dd", hi, lo);
done:;
    Py_buffer *all[5] = {&x, &ab, &be, &na, &nb};
    release(all, 5);
    return result;
}

/* --- numpy's summation order -------------------------------------------------------------
 *
 * ``x.sum()`` of a contiguous float64 array is ``0.0 + pairwise(x)`` and ``np.add.reduceat``
 * gives a segment ``x[a] + pairwise(x[a + 1 : b])``, where pairwise is numpy's
 * (``loops_utils.h``): fewer than 8 values added in order from -0.0 (so a run of -0.0 sums to
 * -0.0); up to 128 values in 8
 * interleaved accumulators, combined ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), the rest
 * added in order; more, split in two at half rounded down to a multiple of 8. ``pairwise``
 * follows that tree exactly. */
enum { PW_BLOCK = 128 };

CLONES_AVX512F
static double pairwise(const double *restrict x, Py_ssize_t n)
{
    if (n < 8) {
        double res = -0.0;
        for (Py_ssize_t i = 0; i < n; i++)
            res += x[i];
        return res;
    }
    if (n <= PW_BLOCK) {
        double r[8];
        for (int j = 0; j < 8; j++)
            r[j] = x[j];
        Py_ssize_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] += x[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += x[i];
        return res;
    }
    Py_ssize_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise(x, n2) + pairwise(x + n2, n - n2);
}

/* ``x.sum()`` */
static double np_sum(const double *x, Py_ssize_t n) { return 0.0 + pairwise(x, n); }

/* ``np.add.reduceat(x, starts)`` into seg (segment s: rows starts[s] .. starts[s + 1] - 1, the
 * last to n - 1; none empty). */
static void np_reduceat(const double *x, const int64_t *starts, Py_ssize_t ns, Py_ssize_t n,
                        double *seg)
{
    for (Py_ssize_t s = 0; s < ns; s++) {
        const Py_ssize_t a = starts[s], b = s + 1 < ns ? starts[s + 1] : n;
        seg[s] = b - a > 1 ? x[a] + pairwise(x + a + 1, b - a - 1) : x[a];
    }
}

/* --- importance-sampling weights ------------------------------------------------------ */

/* One IS spec on a batch: the raw weight of row i is raw[i] (token level) or raw[seg[i]]
 * (sequence level: raw per sequence), 0 where the row is padding (valid[i] == 0; valid NULL:
 * no padding); the weight is min(raw, upper) (TIS: lower NaN) or raw inside [lower, upper],
 * else 0 (IcePop), as ``weights.truncate`` computes them. Fills x (raw), w and w2 (w * w) for
 * the n rows (x: the raw weights themselves at token level without padding, else xbuf), each a
 * plain pass the compiler vectorises. */
CLONES_AVX512F
static const double *weights_of(const double *restrict raw, const int64_t *restrict seg,
                                const uint8_t *restrict valid, double upper, double lower,
                                Py_ssize_t n, double *restrict xbuf, double *restrict w,
                                double *restrict w2)
{
    const double *x = raw; /* token level without padding: the raw weights as they are */
    if (seg || valid) {
        if (seg)
            for (Py_ssize_t i = 0; i < n; i++)
                xbuf[i] = raw[seg[i]];
        else
            for (Py_ssize_t i = 0; i < n; i++)
                xbuf[i] = raw[i];
        if (valid)
            for (Py_ssize_t i = 0; i < n; i++)
                xbuf[i] = valid[i] ? xbuf[i] : 0.0;
        x = xbuf;
    }
    if (isnan(lower)) /* np.minimum: x unless x > upper (no NaN here) */
        for (Py_ssize_t i = 0; i < n; i++)
            w[i] = x[i] > upper ? upper : x[i];
    else
        for (Py_ssize_t i = 0; i < n; i++)
            w[i] = x[i] >= lower && x[i] <= upper ? x[i] : 0.0;
    for (Py_ssize_t i = 0; i < n; i++)
        w2[i] = w[i] * w[i];
    return x;
}

/* What the IS metrics count of the valid rows (valid NULL: every row): the extremes of w, the
 * raw weights above upper and below low, and per sequence the rows of weight 0 (as floats). */
typedef struct {
    double hi, lo;
    int64_t above, below;
} Tally;

CLONES_AVX512F
static void tally(const double *restrict x, const double *restrict w,
                  const uint8_t *restrict valid, double upper, double low,
                  const int64_t *restrict starts, Py_ssize_t ns, Py_ssize_t n,
                  double *restrict zeros, Tally *t)
{
    /* eight lanes (row i in lane i % 8 of its group of eight) for the extremes and counts:
     * independent chains the compiler turns into vector operations */
    double hi[8], lo[8];
    int64_t above[8] = {0}, below[8] = {0};
    for (int l = 0; l < 8; l++)
        hi[l] = -INFINITY, lo[l] = INFINITY;
    const Py_ssize_t n8 = n - n % 8;
    if (!valid) {
        v8d hi8 = load8(hi), lo8 = load8(lo);
        v8l above8 = {0}, below8 = {0};
        for (Py_ssize_t i = 0; i < n8; i += 8) {
            const v8d w8 = load8(w + i), x8 = load8(x + i);
            hi8 = select8(w8 > hi8, w8, hi8);
            lo8 = select8(w8 < lo8, w8, lo8);
            above8 -= x8 > upper; /* a true compare is -1 */
            below8 -= x8 < low;
        }
        memcpy(hi, &hi8, sizeof hi8);
        memcpy(lo, &lo8, sizeof lo8);
        memcpy(above, &above8, sizeof above8);
        memcpy(below, &below8, sizeof below8);
        for (Py_ssize_t i = n8; i < n; i++) {
            hi[0] = w[i] > hi[0] ? w[i] : hi[0];
            lo[0] = w[i] < lo[0] ? w[i] : lo[0];
            above[0] += x[i] > upper;
            below[0] += x[i] < low;
        }
        for (Py_ssize_t s = 0; s < ns; s++) {
            const Py_ssize_t a = starts[s], b = s + 1 < ns ? starts[s + 1] : n;
            int64_t z = 0;
            for (Py_ssize_t i = a; i < b; i++)
                z += w[i] == 0.0;
            zeros[s] = (double)z;
        }
    } else {
        for (Py_ssize_t s = 0; s < ns; s++) {
            const Py_ssize_t a = starts[s], b = s + 1 < ns ? starts[s + 1] : n;
            int64_t z = 0;
            for (Py_ssize_t i = a; i < b; i++) {
                if (!valid[i])
                    continue;
                hi[0] = w[i] > hi[0] ? w[i] : hi[0];
                lo[0] = w[i] < lo[0] ? w[i] : lo[0];
                above[0] += x[i] > upper;
                below[0] += x[i] < low;
                z += w[i] == 0.0;
            }
            zeros[s] = (double)z;
        }
    }
    t->hi = hi[0], t->lo = lo[0], t->above = above[0], t->below = below[0];
    for (int l = 1; l < 8; l++) {
        t->hi = hi[l] > t->hi ? hi[l] : t->hi;
        t->lo = lo[l] < t->lo ? lo[l] : t->lo;
        t->above += above[l];
        t->below += below[l];
    }
}

/* is_stats(raw, sequence, seg, valid, upper, lower, starts, seg_sums, seg_zeros) ->
 *     (sum_w, sum_w2, w_max, w_min, n_raw_above_upper, n_raw_below_low)
 *
 * raw: float64 [N] (token level: sequence False, seg empty) or [S] (sequence level: seg int64
 * [N], each row's sequence); valid: bool [N]
 * or empty (no padding); lower: NaN for TIS; starts: int64 [S]. Fills seg_sums (float64
 * [3 * S]: each sequence's sum of w, of w * w and of the raw weight, as ``np.add.reduceat``)
 * and seg_zeros (float64 [S]: valid rows of weight 0). Returns ``w.sum()``, ``(w * w).sum()``,
 * the extremes of w over the valid rows (-inf, inf for none), and the valid rows whose raw weight
 * is above upper and below ``low`` (lower, or 1 / upper for TIS). */
static PyObject *is_stats(PyObject *self, PyObject *args)
{
    Py_buffer raw, seg, val, st, out, zeros;
    double upper, lower;
    int sequence;
    raw.obj = seg.obj = val.obj = st.obj = out.obj = zeros.obj = NULL;
    if (!PyArg_ParseTuple(args, "y*py*y*ddy*w*w*", &raw, &sequence, &seg, &val, &upper, &lower,
                          &st, &out, &zeros))
        return NULL;
    PyObject *result = NULL;
    double *scratch = NULL;
    Py_ssize_t nraw = -1, nseg = -1, nval = -1, ns = -1, nout = -1, nz = -1;
    if (take(&raw, &nraw, 8, "raw") < 0 || take(&seg, &nseg, 8, "seg") < 0 ||
        take(&val, &nval, 1, "valid") < 0 || take(&st, &ns, 8, "starts") < 0 ||
        take(&out, &nout, 8, "seg_sums") < 0 || take(&zeros, &nz, 8, "seg_zeros") < 0)
        goto done;
    const Py_ssize_t n = sequence ? nseg : nraw, nseq = n ? ns : 0;
    if (nout != 3 * ns || nz != ns || (nval && nval != n) || (n && ns < 1) ||
        (sequence ? nraw != ns : nseg != 0)) {
        PyErr_SetString(PyExc_ValueError, "_kernels.is_stats: sizes do not match");
        goto done;
    }
    scratch = PyMem_RawMalloc(3 * (size_t)(n ? n : 1) * sizeof(double));
    if (!scratch) {
        PyErr_NoMemory();
        goto done;
    }
    double *w = scratch + n, *w2 = scratch + 2 * n, *segs = out.buf, sums[2];
    const uint8_t *valid = nval ? val.buf : NULL;
    const int64_t *starts = st.buf;
    const double low = isnan(lower) ? 1.0 / upper : lower;
    Tally t;
    Py_BEGIN_ALLOW_THREADS
    const double *x =
        weights_of(raw.buf, sequence ? seg.buf : NULL, valid, upper, lower, n, scratch, w, w2);
    sums[0] = np_sum(w, n);
    sums[1] = np_sum(w2, n);
    np_reduceat(w, starts, nseq, n, segs);
    np_reduceat(w2, starts, nseq, n, segs + ns);
    np_reduceat(x, starts, nseq, n, segs + 2 * ns);
    tally(x, w, valid, upper, low, starts, nseq, n, zeros.buf, &t);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("ddddLL", sums[0], sums[1], t.hi, t.lo, (long long)t.above,
                           (long long)t.below);
done:
    PyMem_RawFree(scratch);
    Py_buffer *all[6] = {&raw, &seg, &val, &st, &out, &zeros};
    release(all, 6);
    return result;
}

/* --- integrity checks ---------------------------------------------------------------------- */

/* The counts ``integrity`` fills (int64), by index. */
enum {
    IC_VALID, IC_VALID_SEQS, IC_IDENTICAL, IC_COPIED_SEQS, IC_COPIED_TOKENS,
    IC_NONFINITE, IC_POSITIVE, IC_IMPLAUSIBLE, IC_PLACEHOLDER, /* tokens flagged */
    IC_NONFINITE_SEQS, IC_POSITIVE_SEQS, IC_IMPLAUSIBLE_SEQS, IC_PLACEHOLDER_SEQS,
    IC_PAIRS, IC_SHIFTED_SEQS, IC_HELD_N,
    IC_FINITE, IC_FINITE_SEQS, IC_NEG, IC_POS, IC_NEG_SEQS, IC_POS_SEQS, IC_COUNT
};
/* The floats it fills, by index: the largest log-prob of a positive token (-inf: none), the
 * smallest of an implausible one (inf: none), L(k)'s sums over the interior tokens for
 * k = -1, 0, +1, and the same over the shifted sequences' interior tokens alone. */
enum { IS_POSITIVE_MAX, IS_IMPLAUSIBLE_MIN, IS_SHIFT, IS_HELD = IS_SHIFT + 3, IS_COUNT = IS_HELD + 3 };

typedef struct {
    double floor, positive_above, implausible_below, placeholder_below, shift_ratio,
        shift_min_l0, different;
    int64_t copy_min;
} Limits;

/* A row's integrity flags, by bit (one byte a row), as ``IntegrityAccumulator.update``
 * defines them; the four token flags in the order of IC_NONFINITE .. IC_PLACEHOLDER. */
enum { B_VALID, B_SAME, B_NONFINITE, B_POSITIVE, B_IMPLAUSIBLE, B_PLACEHOLDER, B_FINITE, NFLAGS };

/* Per row of a batch, each a plain loop the compiler vectorises: the flags and the log-probs
 * clamped to the floor (np.maximum(x, floor) of a finite x: x unless x < floor). Returns the
 * flags of any row (or-ed together); all_rows: those of every row (and-ed). */
CLONES_AVX512F
static unsigned integrity_rows(Py_ssize_t n, const double *restrict train,
                               const double *restrict rollout, const uint8_t *restrict valid,
                               const uint8_t *restrict flip, const Limits *lim,
                               uint8_t *restrict flag, double *restrict tc, double *restrict rc,
                               unsigned *all_rows)
{
    const double above = lim->positive_above, below = lim->implausible_below,
                 other = lim->placeholder_below, floor = lim->floor;
    unsigned any = 0, all = (1u << NFLAGS) - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        const double t = train[i], r = rollout[i];
        const unsigned v = valid[i] != 0;
        const unsigned ok = v & (fabs(t) <= DBL_MAX) & (fabs(r) <= DBL_MAX);
        const unsigned outside = (t == -INFINITY) & (flip[i] != 0); /* a flip's -inf: measured */
        const unsigned f =
            v << B_VALID | (v & (t == r)) << B_SAME | (v & !ok & !outside) << B_NONFINITE |
            (ok & ((t > above) | (r > above))) << B_POSITIVE |
            (ok & ((t < below) | (r < below))) << B_IMPLAUSIBLE |
            (ok & (((t == 0.0) & (r < other)) | ((r == 0.0) & (t < other)))) << B_PLACEHOLDER |
            ok << B_FINITE;
        flag[i] = (uint8_t)f;
        any |= f;
        all &= f;
    }
    *all_rows = all;
    for (Py_ssize_t i = 0; i < n; i++)
        tc[i] = train[i] < floor ? floor : train[i];
    for (Py_ssize_t i = 0; i < n; i++)
        rc[i] = rollout[i] < floor ? floor : rollout[i];
    return any;
}

/* The rows a .. b - 1 with flag ``bit``. */
CLONES_AVX512F
static int64_t count_flag(const uint8_t *restrict flag, Py_ssize_t a, Py_ssize_t b, int bit)
{
    int64_t k = 0;
    for (Py_ssize_t i = a; i < b; i++)
        k += flag[i] >> bit & 1;
    return k;
}

/* Whether rows a .. b - 1 are at consecutive positions. */
CLONES_AVX512F
static int consecutive(const int64_t *restrict pos, Py_ssize_t a, Py_ssize_t b)
{
    int64_t k = 0;
    for (Py_ssize_t i = a; i + 1 < b; i++)
        k += (uint64_t)pos[i + 1] == (uint64_t)pos[i] + 1;
    return k == (b > a ? b - a - 1 : 0);
}

/* A sequence whose every row is a finite valid token: x = tc and y = tc - rc of its m rows. */
CLONES_AVX512F
static void plain_rows(Py_ssize_t m, const double *restrict tc, const double *restrict rc,
                       double *restrict x, double *restrict y)
{
    for (Py_ssize_t i = 0; i < m; i++)
        x[i] = tc[i];
    for (Py_ssize_t i = 0; i < m; i++)
        y[i] = tc[i] - rc[i];
}

/* A sequence whose every row is a finite valid token, at consecutive positions: the
 * |tc[t] - rc[t + k]| (k = -1, 0, +1) of its interior rows t = 1 .. m. */
CLONES_AVX512F
static void plain_shifts(Py_ssize_t m, const double *restrict tc, const double *restrict rc,
                         double *restrict d0, double *restrict d1, double *restrict d2)
{
    for (Py_ssize_t i = 0; i < m; i++)
        d0[i] = fabs(tc[i + 1] - rc[i]);
    for (Py_ssize_t i = 0; i < m; i++)
        d1[i] = fabs(tc[i + 1] - rc[i + 1]);
    for (Py_ssize_t i = 0; i < m; i++)
        d2[i] = fabs(tc[i + 1] - rc[i + 2]);
}

/* Rows a .. b - 1 of one sequence, in position order: the counts, extremes and compacted
 * arrays of the integrity checks (see ``integrity``). any, all: the flags of any row of the
 * batch and those of every row (a flag no row has is counted nowhere). d: three arrays, the
 * interior tokens' |train[t] - rollout[t + k]| for k = -1, 0, +1 compacted in row order; kd:
 * how many each holds; held: three arrays, the shifted sequences' sums of d
 * (c[IC_SHIFTED_SEQS] each). A compacted array is written a row at a time, the next row's
 * place taken only where the row counts (no branch), or, where every row counts (the usual
 * sequence), by the plain loops above. */
static void integrity_sequence(Py_ssize_t a, Py_ssize_t b, unsigned any, unsigned all,
                               const int64_t *restrict pos, const double *restrict train,
                               const double *restrict rollout, const uint8_t *restrict flag,
                               const double *restrict tc, const double *restrict rc,
                               const Limits *lim, int64_t *restrict c, double *restrict f,
                               double *const *d, Py_ssize_t *kd, double *restrict x,
                               double *restrict y, double *restrict neg, double *restrict posd,
                               double *const *held)
{
    const Py_ssize_t len = b - a;
    int64_t counts[NFLAGS]; /* rows of each flag */
    for (int k = 0; k < NFLAGS; k++)
        counts[k] = !(any >> k & 1) ? 0 : all >> k & 1 ? len : count_flag(flag, a, b, k);
    const int64_t valid_n = counts[B_VALID], same_n = counts[B_SAME], fin_n = counts[B_FINITE];
    if (counts[B_POSITIVE] | counts[B_IMPLAUSIBLE]) /* rare: those tokens' extremes */
        for (Py_ssize_t i = a; i < b; i++) {
            const double t = train[i], r = rollout[i];
            if (flag[i] >> B_POSITIVE & 1) {
                const double m = t >= r ? t : r; /* np.maximum */
                f[IS_POSITIVE_MAX] = m > f[IS_POSITIVE_MAX] ? m : f[IS_POSITIVE_MAX];
            }
            if (flag[i] >> B_IMPLAUSIBLE & 1) {
                const double m = t <= r ? t : r; /* np.minimum */
                f[IS_IMPLAUSIBLE_MIN] = m < f[IS_IMPLAUSIBLE_MIN] ? m : f[IS_IMPLAUSIBLE_MIN];
            }
        }
    c[IC_VALID] += valid_n;
    c[IC_VALID_SEQS] += valid_n > 0;
    c[IC_IDENTICAL] += same_n;
    if (valid_n >= lim->copy_min && same_n == valid_n) {
        c[IC_COPIED_SEQS] += 1;
        c[IC_COPIED_TOKENS] += valid_n;
    }
    for (int k = 0; k < 4; k++) {
        c[IC_NONFINITE + k] += counts[B_NONFINITE + k];
        c[IC_NONFINITE_SEQS + k] += counts[B_NONFINITE + k] > 0;
    }
    /* the sampling checks' values of the finite tokens, compacted in row order */
    const Py_ssize_t kx0 = c[IC_FINITE];
    if (fin_n == len) {
        plain_rows(len, tc + a, rc + a, x + kx0, y + kx0);
    } else {
        Py_ssize_t kx = kx0;
        for (Py_ssize_t i = a; i < b; i++) {
            x[kx] = tc[i];
            y[kx] = tc[i] - rc[i];
            kx += flag[i] >> B_FINITE & 1;
        }
    }
    Py_ssize_t kn = c[IC_NEG], kp = c[IC_POS];
    const double different = lim->different;
    for (Py_ssize_t j = kx0; j < kx0 + fin_n; j++) {
        const double yr = y[j];
        neg[kn] = -yr; /* |y| where y < -different */
        kn += yr < -different;
        posd[kp] = yr;
        kp += yr > different;
    }
    c[IC_FINITE] += fin_n, c[IC_FINITE_SEQS] += fin_n > 0;
    c[IC_NEG_SEQS] += kn > c[IC_NEG], c[IC_POS_SEQS] += kp > c[IC_POS];
    c[IC_NEG] = kn, c[IC_POS] = kp;
    /* L(k): the interior tokens t (t - 1, t, t + 1 finite tokens of this sequence, at
     * consecutive positions) */
    if (len < 3)
        return;
    const Py_ssize_t first = *kd;
    Py_ssize_t k = first;
    if (fin_n == len && consecutive(pos, a, b)) {
        plain_shifts(len - 2, tc + a, rc + a, d[0] + k, d[1] + k, d[2] + k);
        k += len - 2;
    } else {
        for (Py_ssize_t i = a + 1; i + 1 < b; i++) {
            const double t = tc[i];
            d[0][k] = fabs(t - rc[i - 1]);
            d[1][k] = fabs(t - rc[i]);
            d[2][k] = fabs(t - rc[i + 1]);
            k += (flag[i - 1] & flag[i] & flag[i + 1]) >> B_FINITE & 1 &&
                 (uint64_t)pos[i] == (uint64_t)pos[i - 1] + 1 &&
                 (uint64_t)pos[i + 1] == (uint64_t)pos[i] + 1;
        }
    }
    *kd = k;
    const Py_ssize_t m = k - first;
    if (!m)
        return;
    double s[3]; /* np.add.reduceat's sum of this sequence's run */
    for (int j = 0; j < 3; j++)
        s[j] = m > 1 ? d[j][first] + pairwise(d[j] + first + 1, m - 1) : d[j][first];
    const double lm = s[0] / (double)m, l0 = s[1] / (double)m, lp = s[2] / (double)m;
    if ((lm <= lp ? lm : lp) < lim->shift_ratio * l0 && l0 > lim->shift_min_l0) {
        const int64_t h = c[IC_SHIFTED_SEQS]++;
        c[IC_HELD_N] += m;
        for (int j = 0; j < 3; j++)
            held[j][h] = s[j];
    }
}

/* integrity(pos, train, rollout, valid, flip, starts, limits, copy_min, counts, sums, x, y,
 *           neg, pos_abs) -> None
 *
 * The integrity checks of a batch of whole sequences, each sequence's rows together and in
 * position order (``integrity._by_sequence``): pos int64 [N], train and rollout float64 [N]
 * (anything at padding), valid and flip bool [N], starts int64 [S] (each sequence's first
 * row), limits float64 [7] (the log-prob floor, ``POSITIVE_ABOVE``, ``IMPLAUSIBLE_BELOW``,
 * ``PLACEHOLDER_OTHER_BELOW``, ``SHIFT_RATIO``, ``SHIFT_MIN_L0``, ``DIFFERENT``), copy_min
 * ``COPY_MIN_SEQ_TOKENS``. Fills counts (int64 [IC_COUNT]) and sums (float64 [IS_COUNT]), and
 * compacts the finite valid tokens' x = max(train, floor) and y = x - max(rollout, floor) into
 * x and y, and |y| of those with y < -different into neg, y of those with y > different into
 * pos_abs (float64 [N] each; counts says how many each holds): the values, counts and sums of
 * ``IntegrityAccumulator.update``'s numpy calls (the sums in numpy's order, ``np_sum`` and
 * ``np.add.reduceat``), which the caller adds to its state as those calls do. */
static PyObject *integrity(PyObject *self, PyObject *args)
{
    Py_buffer in[7], out[6];
    long long copy_min;
    for (int k = 0; k < 7; k++)
        in[k].obj = NULL;
    for (int k = 0; k < 6; k++)
        out[k].obj = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*Lw*w*w*w*w*w*", &in[0], &in[1], &in[2], &in[3],
                          &in[4], &in[5], &in[6], &copy_min, &out[0], &out[1], &out[2],
                          &out[3], &out[4], &out[5]))
        return NULL;
    PyObject *result = NULL;
    double *scratch = NULL;
    Py_ssize_t n = -1, ns = -1, nl = 7, nc = IC_COUNT, nf = IS_COUNT;
    const char *names[5] = {"pos", "train", "rollout", "valid", "flip"};
    const Py_ssize_t sizes[5] = {8, 8, 8, 1, 1};
    for (int k = 0; k < 5; k++)
        if (take(&in[k], &n, sizes[k], names[k]) < 0)
            goto done;
    if (take(&in[5], &ns, 8, "starts") < 0 || take(&in[6], &nl, 8, "limits") < 0 ||
        take(&out[0], &nc, 8, "counts") < 0 || take(&out[1], &nf, 8, "sums") < 0)
        goto done;
    const char *outs[4] = {"x", "y", "neg", "pos_abs"};
    for (int k = 0; k < 4; k++)
        if (take(&out[2 + k], &n, 8, outs[k]) < 0)
            goto done;
    const int64_t *starts = in[5].buf;
    int ordered = ns >= 1 && starts[0] == 0;
    for (Py_ssize_t s = 1; s < ns && ordered; s++)
        ordered = starts[s] > starts[s - 1] && starts[s] < n;
    if (!ordered) {
        PyErr_SetString(PyExc_ValueError, "_kernels.integrity: starts are not sequence starts");
        goto done;
    }
    scratch = PyMem_RawMalloc((5 * (size_t)n + 3 * (size_t)ns + 1) * sizeof(double) + (size_t)n);
    if (!scratch) {
        PyErr_NoMemory();
        goto done;
    }
    const double *l = in[6].buf;
    const Limits lim = {.floor = l[0], .positive_above = l[1], .implausible_below = l[2],
                        .placeholder_below = l[3], .shift_ratio = l[4], .shift_min_l0 = l[5],
                        .different = l[6], .copy_min = (int64_t)copy_min};
    int64_t *c = out[0].buf;
    double *f = out[1].buf;
    double *d[3] = {scratch, scratch + n, scratch + 2 * n}, *tc = scratch + 3 * n,
           *rc = scratch + 4 * n;
    double *held[3] = {scratch + 5 * n, scratch + 5 * n + ns, scratch + 5 * n + 2 * ns};
    uint8_t *flag = (uint8_t *)(scratch + 5 * n + 3 * ns + 1);
    Py_BEGIN_ALLOW_THREADS
    memset(c, 0, IC_COUNT * sizeof *c);
    f[IS_POSITIVE_MAX] = -INFINITY, f[IS_IMPLAUSIBLE_MIN] = INFINITY;
    unsigned all;
    const unsigned any = integrity_rows(n, in[1].buf, in[2].buf, in[3].buf, in[4].buf, &lim,
                                        flag, tc, rc, &all);
    Py_ssize_t kd = 0;
    for (Py_ssize_t s = 0; s < ns; s++)
        integrity_sequence(starts[s], s + 1 < ns ? starts[s + 1] : n, any, all, in[0].buf,
                           in[1].buf, in[2].buf, flag, tc, rc, &lim, c, f, d, &kd, out[2].buf,
                           out[3].buf, out[4].buf, out[5].buf, held);
    c[IC_PAIRS] = kd;
    for (int k = 0; k < 3; k++) {
        f[IS_SHIFT + k] = np_sum(d[k], kd);
        f[IS_HELD + k] = np_sum(held[k], c[IC_SHIFTED_SEQS]);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_RawFree(scratch);
    Py_buffer *all[13] = {&in[0], &in[1], &in[2], &in[3], &in[4], &in[5], &in[6],
                          &out[0], &out[1], &out[2], &out[3], &out[4], &out[5]};
    release(all, 13);
    return result;
}

static PyMethodDef methods[] = {
    {"curves", curves, METH_VARARGS,
     "curves(r, abs_r, k3, dp, p_rollout, p_train, position, hist_bounds, hist_scale, "
     "hist_offset, hist_lo, hist_step, pos_edges, prob_edges, hist2d_bins, hist, hist2d, "
     "cell_count, cell_sums) -> None"},
    {"thresholds", thresholds, METH_VARARGS,
     "thresholds(x, center, above, below, n_above, n_below) -> (max, min)"},
    {"is_stats", is_stats, METH_VARARGS,
     "is_stats(raw, sequence, seg, valid, upper, lower, starts, seg_sums, seg_zeros) -> (sum_w, "
     "sum_w2, "
     "w_max, w_min, n_high, n_low)"},
    {"integrity", integrity, METH_VARARGS,
     "integrity(pos, train, rollout, valid, flip, starts, limits, copy_min, counts, sums, x, y, "
     "neg, pos_abs) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kernels", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
