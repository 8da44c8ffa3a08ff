/* _kernels: per-token loops of the metric engine, one pass where numpy makes many.
 *
 * Each function takes the batch's arrays (anything with the buffer protocol: C-contiguous
 * numpy arrays of the dtype named) and adds into output arrays it is handed, so Python keeps
 * the state. Each gives the bits of the numpy calls it replaces (``curves.py`` keeps them, for
 * a build without a C compiler, and ``tests/test_metrics_compiled.py`` compares the two):
 *
 *   - a bin is found by comparisons with the same bounds numpy's code compares with, from a
 *     guess made with the same arithmetic (compiled with ``-ffp-contract=off``: no fused
 *     multiply-add);
 *   - a bin's sum adds its values in row order, one IEEE addition at a time, as
 *     ``np.bincount(idx, weights=w)`` does; counts are integers.
 *
 * The interpreter lock is released during each loop, so batches compute on every core.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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

/* The slot of ``x`` among ``bounds`` (slot s: bounds[s] <= x < bounds[s + 1]) from a guess
 * ``clip(g, 0, top)`` truncated, at most one off: numpy's ``guess -= x < bounds[guess];
 * guess += x >= bounds[guess + 1]``. NaN guesses are slot 0 (not reached: inputs are finite). */
static inline Py_ssize_t corrected(double x, double g, double top, const double *bounds)
{
    g = g > 0.0 ? g : 0.0;
    g = g < top ? g : top;
    Py_ssize_t s = (Py_ssize_t)g;
    s -= x < bounds[s];
    s += x >= bounds[s + 1];
    return s;
}

enum { NSUMS = 4 };

/* The bins of one batch (see ``curves``): sizes, bounds and tables. */
typedef struct {
    const double *hbounds;    /* uniform_hist's bins + 4 slot bounds */
    double hscale, hoffset, htop;  /* its guess: clip(r * hscale + hoffset, 0, htop) */
    const int64_t *pos_table; /* position bin of positions 0 .. npt - 1 */
    int64_t pos_last;         /* npt - 1 */
    const int64_t *prob_guess;  /* probability bin of floor(1000 p) */
    double ptop;              /* 1000 */
    const double *pbounds;    /* nprob + 1 probability bin bounds */
    Py_ssize_t nprob, nb2, ncell;
} Bins;

static void curves_loop(Py_ssize_t n, const double *restrict r, const double *restrict abs_r,
                        const double *restrict k3, const double *restrict dp,
                        const double *restrict pr, const double *restrict ptr,
                        const int64_t *restrict pos, const Bins *bins, int64_t *restrict hist,
                        int64_t *restrict hist2d, int64_t *restrict count,
                        double *restrict sums)
{
    const Bins z = *bins;
    const double top2 = (double)(z.nb2 - 1), nb2 = (double)z.nb2;
    double *restrict s0 = sums, *restrict s1 = sums + z.ncell, *restrict s2 = sums + 2 * z.ncell,
                     *restrict s3 = sums + 3 * z.ncell;
    for (Py_ssize_t i = 0; i < n; i++) {
        const double x = r[i], p = pr[i];
        const Py_ssize_t slot = corrected(x, x * z.hscale + z.hoffset, z.htop, z.hbounds);
        double gx = p * nb2, gy = ptr[i] * nb2;
        gx = gx > 0.0 ? (gx < top2 ? gx : top2) : 0.0;
        gy = gy > 0.0 ? (gy < top2 ? gy : top2) : 0.0;
        const Py_ssize_t cell2 = (Py_ssize_t)gx * z.nb2 + (Py_ssize_t)gy;
        const int64_t q = pos[i] > 0 ? (pos[i] < z.pos_last ? pos[i] : z.pos_last) : 0;
        double g = p * z.ptop;
        g = g > 0.0 ? (g < z.ptop ? g : z.ptop) : 0.0;
        Py_ssize_t b = (Py_ssize_t)z.prob_guess[(Py_ssize_t)g];
        b -= p < z.pbounds[b];
        b += p >= z.pbounds[b + 1];
        const Py_ssize_t c = (Py_ssize_t)z.pos_table[q] * z.nprob + b;
        const double v0 = x, v1 = abs_r[i], v2 = k3[i], v3 = dp[i];
        hist[slot] += 1;
        hist2d[cell2] += 1;
        count[c] += 1;
        s0[c] += v0;
        s1[c] += v1;
        s2[c] += v2;
        s3[c] += v3;
    }
}

/* curves(r, abs_r, k3, dp, p_rollout, p_train, position,
 *        hist_bounds, hist_scale, hist_offset, pos_table, prob_guess, prob_bounds, hist2d_bins,
 *        hist, hist2d, cell_count, cell_sums)
 *
 * For the N valid tokens (float64 arrays; position int64), adds:
 *   hist[s]        += 1, s = uniform_hist's slot of r (hist_bounds: its bounds, bins + 4 of
 *                    them; guess r * hist_scale + hist_offset clipped to [0, bins + 1]);
 *   hist2d[i * B + j] += 1, i, j = min(floor(clip(p * B, 0, B - 1))) of p_rollout, p_train;
 *   cell_count[c]  += 1 and cell_sums[k * C + c] += (r, abs_r, k3, dp)[k], c = position bin *
 *                    P + probability bin (P = len(prob_bounds) - 1 bins; C cells):
 *                    position bin pos_table[clip(position, 0, len(pos_table) - 1)], probability
 *                    bin prob_guess[clip(p_rollout * 1000, 0, 1000)] corrected by prob_bounds. */
static PyObject *curves(PyObject *self, PyObject *args)
{
    Py_buffer in[7], hb, pt, pg, pb, out[4];
    double hscale, hoffset;
    Py_ssize_t nb2;
    for (int k = 0; k < 7; k++)
        in[k].obj = NULL;
    hb.obj = pt.obj = pg.obj = pb.obj = NULL;
    for (int k = 0; k < 4; k++)
        out[k].obj = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*ddy*y*y*nw*w*w*w*", &in[0], &in[1], &in[2],
                          &in[3], &in[4], &in[5], &in[6], &hb, &hscale, &hoffset, &pt, &pg, &pb,
                          &nb2, &out[0], &out[1], &out[2], &out[3]))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = -1, nhb = -1, npt = -1, npg = -1, npb = -1, nh = -1, n2 = -1, nc = -1, ns = -1;
    const char *names[7] = {"r", "abs_r", "k3", "dp", "p_rollout", "p_train", "position"};
    for (int k = 0; k < 7; k++)
        if (take(&in[k], &n, 8, names[k]) < 0)
            goto done;
    if (take(&hb, &nhb, 8, "hist_bounds") < 0 || take(&pt, &npt, 8, "pos_table") < 0 ||
        take(&pg, &npg, 8, "prob_guess") < 0 || take(&pb, &npb, 8, "prob_bounds") < 0 ||
        take(&out[0], &nh, 8, "hist") < 0 || take(&out[1], &n2, 8, "hist2d") < 0 ||
        take(&out[2], &nc, 8, "cell_count") < 0 || take(&out[3], &ns, 8, "cell_sums") < 0)
        goto done;
    const Py_ssize_t nprob = npb - 1, nbins = nhb - 4;
    const Py_ssize_t npos = nc / (nprob > 0 ? nprob : 1);
    if (nbins < 1 || nh != nbins + 3 || nb2 < 1 || n2 != nb2 * nb2 || npg < 2 || nprob < 1 ||
        npt < 1 || nc != npos * nprob || ns != NSUMS * nc) {
        PyErr_SetString(PyExc_ValueError, "_kernels.curves: output sizes do not match the bins");
        goto done;
    }
    const Bins bins = {.hbounds = hb.buf, .hscale = hscale, .hoffset = hoffset,
                       .htop = (double)(nbins + 1), .pos_table = pt.buf, .pos_last = npt - 1,
                       .prob_guess = pg.buf, .ptop = (double)(npg - 1), .pbounds = pb.buf,
                       .nprob = nprob, .nb2 = nb2, .ncell = nc};
    Py_BEGIN_ALLOW_THREADS
    curves_loop(n, in[0].buf, in[1].buf, in[2].buf, in[3].buf, in[4].buf, in[5].buf, in[6].buf,
                &bins, out[0].buf, out[1].buf, out[2].buf, out[3].buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (int k = 0; k < 7; k++)
        if (in[k].obj)
            PyBuffer_Release(&in[k]);
    Py_buffer *rest[8] = {&hb, &pt, &pg, &pb, &out[0], &out[1], &out[2], &out[3]};
    for (int k = 0; k < 8; k++)
        if (rest[k]->obj)
            PyBuffer_Release(rest[k]);
    return result;
}

static PyMethodDef methods[] = {
    {"curves", curves, METH_VARARGS,
     "curves(r, abs_r, k3, dp, p_rollout, p_train, position, hist_bounds, hist_scale, "
     "hist_offset, pos_table, prob_guess, prob_bounds, hist2d_bins, hist, hist2d, cell_count, "
     "cell_sums) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kernels", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
