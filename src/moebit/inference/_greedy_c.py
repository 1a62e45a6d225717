"""Greedy decoding, many steps to a native call: the C that ``_fused_c`` builds after ``fd_step``.

Why: at batch 1 on a small MoE a native step takes about half a millisecond, and the
Python around it (the module call, the step's tensors, the argmax, the per-row
bookkeeping, the next ids) cost another 60-120 us, 10-20% of every token. When every
row decodes greedily and nothing but token ids can stop it, the next token depends on
nothing Python does, so ``fd_greedy`` runs the steps back to back: each is ``fd_step``
itself, then each live row's argmax (the first maximum, a NaN counting as the maximum,
as torch's argmax) over the logits the step wrote.

A row stops on an id in ``eos`` (kept as its last token) or at its budget; after that it
keeps feeding its last id and its cache column advances with the others, with its
feed-forward skipped (``live``), exactly as ``generate``'s step-by-step loop leaves it.
"""

SOURCE = r"""
#include <time.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Up to ``steps`` greedy steps of R rows. ids [R]: each row's next input, rewritten with
   its newest token; col [R]: each row's next column, advanced by one a step; live [R]:
   cleared when a row stops. out [R, steps] takes row r's new tokens, nout [R] counts them
   (rows start at nout[r] = 0), budget [R] caps them; t_ns [steps]: each step's wall time.
   The logits of every row are written to ``logits`` [R, vocab] each step (the last
   step's are left there). Returns the steps run, or -(fd_step's code) when a step
   refused its arguments (no token of that step is taken). */
int64_t fd_greedy(const fd_model *m, int64_t R, int64_t *ids, const float *cos_,
                  const float *sin_, int64_t rw, const int64_t *slot, const int64_t *first,
                  int64_t *col, uint8_t *live, float *const *kc, float *const *vc,
                  int64_t tmax, float *logits, int nthreads, int64_t steps,
                  const int64_t *eos, int64_t neos, const int64_t *budget, int64_t *out,
                  int64_t *nout, int64_t *t_ns) {
    const int64_t V = m->vocab;
    int64_t s = 0;
    for (; s < steps; s++) {
        int64_t any = 0;
        for (int64_t r = 0; r < R; r++) any |= live[r];
        if (!any) break;
        const int64_t t0 = now_ns();
        const int rc = fd_step(m, R, ids, cos_, sin_, rw, 1, slot, first, col, live, kc, vc,
                               tmax, logits, nthreads, 0, -1);
        if (rc) return -rc;
        for (int64_t r = 0; r < R; r++) {
            col[r]++;
            if (!live[r]) continue;
            const float *lg = logits + r * V;
            int64_t best = 0;
            for (int64_t v = 0; v < V && lg[best] == lg[best]; v++)
                if (lg[v] > lg[best] || lg[v] != lg[v]) best = v;
            out[r * steps + nout[r]++] = best;
            ids[r] = best;
            int stop = nout[r] >= budget[r];
            for (int64_t i = 0; i < neos; i++) stop |= eos[i] == best;
            if (stop) live[r] = 0;
        }
        t_ns[s] = now_ns() - t0;
    }
    return s;
}
"""
