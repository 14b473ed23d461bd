/* Digest jobs: the xxh3-128 digests of a pull's destination spans, hashed as the reads land.
 *
 * A pull's digest plan: per destination region its reads (offset, length: sorted, disjoint) and its
 * spans (offset, end: sorted by offset, may overlap). A core thread that reaps a read tagged with a
 * job (rf_op.hjob) calls rf_hjob_landed, which only records it; once every read below some offset has
 * landed, the bytes there are final and the job's own hasher thread feeds them, in address order, to
 * each span's streaming xxh3-128 state, right after they landed. Hashing off the core thread lets the
 * core go on posting and receiving meanwhile: on shm the core does the copy and a second core is
 * otherwise idle (where the thread cannot be started, the landing thread hashes, one at a time). The
 * job lives until Python released it (which joins the hasher) and no queued or posted op refers to it
 * any more; once released it hashes nothing (the destination may be gone). */
#include <errno.h>
#include <pthread.h>
#include <string.h>

#include "rf_internal.h"

#ifdef RF_HAVE_XXHASH
#include <xxhash.h>
/* Debian's libxxhash picks SSE2/AVX2/AVX-512 at run time here; weak, so other builds link too. */
extern XXH_errorcode XXH3_128bits_update_dispatch(XXH3_state_t *state, const void *input, size_t len)
    __attribute__((weak));
#endif

struct rf_hspan { uint64_t off, end, fed; int done; void *st; unsigned char digest[16]; };
struct rf_hregion {
    uint64_t base, size, hashed; /* bytes below hashed were fed to every span */
    long nreads, k;              /* reads[0..k) have all landed */
    uint64_t *reads, *landed;    /* (offset, length) pairs; bytes landed per read */
    long nspans, first;          /* spans[0..first) are done */
    struct rf_hspan *spans;
};
struct rf_hjob {
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* waiters and rf_hjob_release wait on it */
    pthread_cond_t work_cv; /* the hasher thread sleeps on it */
    pthread_t hasher;
    long refs; /* Python's (until rf_hjob_release) + one per queued or posted tagged op */
    int hashing, released, failed, has_hasher, hasher_idle;
    long nregions;
    struct rf_hregion *r;
    uint64_t hash_ns;
};

#define RF_HASH_STEP (16ULL << 20)

int rf_hjob_supported(void) {
#ifdef RF_HAVE_XXHASH
    return 1;
#else
    return 0;
#endif
}

static void rf_hjob_free(struct rf_hjob *j) {
    for (long q = 0; q < j->nregions; q++) {
        struct rf_hregion *r = &j->r[q];
        for (long s = 0; s < r->nspans; s++) {
#ifdef RF_HAVE_XXHASH
            if (r->spans[s].st)
                XXH3_freeState((XXH3_state_t *)r->spans[s].st);
#endif
        }
        free(r->spans);
        free(r->reads);
        free(r->landed);
    }
    free(j->r);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    pthread_cond_destroy(&j->work_cv);
    free(j);
}

/* Bytes below this offset of region r are final: the end of the last read of the landed prefix. */
static uint64_t rf_final_at(const struct rf_hregion *r) {
    if (r->k == r->nreads)
        return r->size;
    return r->k ? r->reads[2 * (r->k - 1)] + r->reads[2 * (r->k - 1) + 1] : 0;
}

/* Feed region bytes [lo, hi) to every span that overlaps them; finish the spans that end by hi.
 * Only the hashing thread touches the spans. */
static void rf_hash_range(struct rf_hregion *r, uint64_t lo, uint64_t hi) {
#ifdef RF_HAVE_XXHASH
    for (long s = r->first; s < r->nspans; s++) {
        struct rf_hspan *sp = &r->spans[s];
        if (sp->off > hi || (sp->off == hi && sp->end > hi))
            break; /* (an empty span at hi is final) */
        if (sp->done) {
            if (s == r->first)
                r->first++;
            continue;
        }
        uint64_t start = sp->off + sp->fed > lo ? sp->off + sp->fed : lo;
        uint64_t end = sp->end < hi ? sp->end : hi;
        if (end > start) {
            const void *p = (const void *)(uintptr_t)(r->base + start);
            if (XXH3_128bits_update_dispatch)
                XXH3_128bits_update_dispatch((XXH3_state_t *)sp->st, p, (size_t)(end - start));
            else
                XXH3_128bits_update((XXH3_state_t *)sp->st, p, (size_t)(end - start));
            sp->fed = end - sp->off;
        }
        if (sp->end <= hi) {
            XXH128_hash_t h = XXH3_128bits_digest((XXH3_state_t *)sp->st);
            XXH128_canonicalFromHash((XXH128_canonical_t *)sp->digest, h);
            sp->done = 1;
            if (s == r->first)
                r->first++;
        }
    }
#else
    (void)r; (void)lo; (void)hi;
#endif
}

/* Hash whatever became final, unless another thread is at it (it will see the new marks). mu held. */
static void rf_hjob_run(struct rf_hjob *j) {
    if (j->hashing)
        return;
    j->hashing = 1;
    for (;;) {
        struct rf_hregion *r = NULL;
        for (long q = 0; q < j->nregions && !r; q++)
            if (rf_final_at(&j->r[q]) > j->r[q].hashed)
                r = &j->r[q];
        if (!r || j->released)
            break;
        /* at most RF_HASH_STEP at a time, so that a release waits for one step, not a backlog */
        uint64_t lo = r->hashed, hi = rf_final_at(r);
        if (hi - lo > RF_HASH_STEP)
            hi = lo + RF_HASH_STEP;
        pthread_mutex_unlock(&j->mu);
        long t0 = rf_now_ns();
        rf_hash_range(r, lo, hi);
        long dt = rf_now_ns() - t0;
        pthread_mutex_lock(&j->mu);
        r->hashed = hi;
        j->hash_ns += (uint64_t)dt;
    }
    j->hashing = 0;
    pthread_cond_broadcast(&j->cv);
}

/* Whether bytes that landed are waiting to be hashed (mu held). */
static int rf_hjob_pending(const struct rf_hjob *j) {
    for (long q = 0; q < j->nregions; q++)
        if (rf_final_at(&j->r[q]) > j->r[q].hashed)
            return 1;
    return 0;
}

/* The job's hasher thread: hashes what became final until the job is released. */
static void *rf_hjob_main(void *arg) {
    struct rf_hjob *j = arg;
    pthread_mutex_lock(&j->mu);
    while (!j->released) {
        if (rf_hjob_pending(j) && !j->failed) {
            rf_hjob_run(j);
            continue;
        }
        j->hasher_idle = 1;
        pthread_cond_wait(&j->work_cv, &j->mu);
        j->hasher_idle = 0;
    }
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

/* A job for nregions regions: bases/sizes per region; nreads[q] (offset, length) pairs per region in
 * reads, concatenated; nspans[q] (offset, end) pairs per region in spans. Returns NULL without
 * xxhash or memory. The caller holds one reference (rf_hjob_release drops it). */
struct rf_hjob *rf_hjob_new(long nregions, const uint64_t *bases, const uint64_t *sizes, const long *nreads,
                            const uint64_t *reads, const long *nspans, const uint64_t *spans) {
#ifndef RF_HAVE_XXHASH
    (void)nregions; (void)bases; (void)sizes; (void)nreads; (void)reads; (void)nspans; (void)spans;
    return NULL;
#else
    struct rf_hjob *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_cond_init(&j->work_cv, &ca);
    pthread_condattr_destroy(&ca);
    j->refs = 1;
    j->nregions = nregions;
    j->r = calloc((size_t)(nregions > 0 ? nregions : 1), sizeof *j->r);
    if (!j->r)
        goto fail;
    for (long q = 0; q < nregions; q++) {
        struct rf_hregion *r = &j->r[q];
        r->base = bases[q];
        r->size = sizes[q];
        r->nreads = nreads[q];
        r->nspans = nspans[q];
        r->reads = malloc(sizeof(uint64_t) * 2 * (size_t)(r->nreads + 1));
        r->landed = calloc((size_t)(r->nreads + 1), sizeof(uint64_t));
        r->spans = calloc((size_t)(r->nspans + 1), sizeof *r->spans);
        if (!r->reads || !r->landed || !r->spans)
            goto fail;
        memcpy(r->reads, reads, sizeof(uint64_t) * 2 * (size_t)r->nreads);
        reads += 2 * r->nreads;
        for (long s = 0; s < r->nspans; s++) {
            r->spans[s].off = spans[2 * s];
            r->spans[s].end = spans[2 * s + 1];
            r->spans[s].st = XXH3_createState();
            if (!r->spans[s].st || XXH3_128bits_reset((XXH3_state_t *)r->spans[s].st) != XXH_OK)
                goto fail;
        }
        spans += 2 * r->nspans;
    }
    /* it also hashes the regions without reads, final already */
    j->has_hasher = pthread_create(&j->hasher, NULL, rf_hjob_main, j) == 0;
    if (!j->has_hasher) {
        pthread_mutex_lock(&j->mu);
        rf_hjob_run(j);
        pthread_mutex_unlock(&j->mu);
    }
    return j;
fail:
    rf_hjob_free(j);
    return NULL;
#endif
}

void rf_hjob_ref(struct rf_hjob *j) {
    pthread_mutex_lock(&j->mu);
    j->refs++;
    pthread_mutex_unlock(&j->mu);
}

void rf_hjob_unref(struct rf_hjob *j) {
    pthread_mutex_lock(&j->mu);
    long left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left == 0)
        rf_hjob_free(j);
}

/* Mark the job as unusable (an op could not be tracked): rf_hjob_wait then says so. */
void rf_hjob_fail(struct rf_hjob *j) {
    pthread_mutex_lock(&j->mu);
    j->failed = 1;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* Bytes [addr, +len) of one of the job's reads landed (any thread): recorded, and the job's thread
 * woken when more bytes became final (without that thread, hashed here). */
void rf_hjob_landed(struct rf_hjob *j, uint64_t addr, uint64_t len) {
    pthread_mutex_lock(&j->mu);
    if (j->released || j->failed) {
        pthread_mutex_unlock(&j->mu);
        return;
    }
    struct rf_hregion *r = NULL;
    for (long q = 0; q < j->nregions && !r; q++)
        if (addr >= j->r[q].base && addr - j->r[q].base < j->r[q].size)
            r = &j->r[q];
    long i = -1;
    if (r) {
        uint64_t off = addr - r->base;
        long lo = 0, hi = r->nreads - 1;
        while (lo <= hi) {
            long m = lo + (hi - lo) / 2;
            if (r->reads[2 * m] <= off) {
                i = m;
                lo = m + 1;
            } else {
                hi = m - 1;
            }
        }
        if (i >= 0 && off + len > r->reads[2 * i] + r->reads[2 * i + 1])
            i = -1;
    }
    if (i < 0) { /* not a byte range of this job's reads */
        j->failed = 1;
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
        return;
    }
    r->landed[i] += len;
    long k0 = r->k;
    while (r->k < r->nreads && r->landed[r->k] >= r->reads[2 * r->k + 1])
        r->k++;
    if (!j->has_hasher)
        rf_hjob_run(j);
    else if (j->hasher_idle && r->k != k0) /* wake it only when more bytes became final */
        pthread_cond_signal(&j->work_cv);
    pthread_mutex_unlock(&j->mu);
}

/* Wait up to timeout_ms until every region is hashed to its end: 1 when it is, 0 on timeout, -1 when
 * the job failed (a landing outside its reads, or an op it could not track). */
int rf_hjob_wait(struct rf_hjob *j, int timeout_ms) {
    struct timespec ts;
    int rc = 0;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    ts.tv_sec += ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        if (j->failed) {
            rc = -1;
            break;
        }
        int all = !j->hashing;
        for (long q = 0; q < j->nregions && all; q++)
            all = j->r[q].hashed == j->r[q].size;
        if (all) {
            rc = 1;
            break;
        }
        if (pthread_cond_timedwait(&j->cv, &j->mu, &ts) == ETIMEDOUT)
            break;
    }
    pthread_mutex_unlock(&j->mu);
    return rc;
}

/* Copy each span's 16-byte canonical digest (regions in order, spans in the order given) into out;
 * returns how many spans are done (all of them after rf_hjob_wait returned 1). */
long rf_hjob_digests(struct rf_hjob *j, unsigned char *out, long nspans) {
    long done = 0, n = 0;
    pthread_mutex_lock(&j->mu);
    for (long q = 0; q < j->nregions; q++)
        for (long s = 0; s < j->r[q].nspans && n < nspans; s++, n++) {
            memcpy(out + 16 * n, j->r[q].spans[s].digest, 16);
            done += j->r[q].spans[s].done;
        }
    pthread_mutex_unlock(&j->mu);
    return done;
}

uint64_t rf_hjob_hash_ns(struct rf_hjob *j) {
    pthread_mutex_lock(&j->mu);
    uint64_t ns = j->hash_ns;
    pthread_mutex_unlock(&j->mu);
    return ns;
}

/* Python is done with the job: nothing is hashed any more (waits for a hash under way, so the caller
 * may free the destination after this returns); freed once no op refers to it. */
void rf_hjob_release(struct rf_hjob *j) {
    pthread_mutex_lock(&j->mu);
    j->released = 1;
    pthread_cond_signal(&j->work_cv);
    while (j->hashing)
        pthread_cond_wait(&j->cv, &j->mu);
    pthread_mutex_unlock(&j->mu);
    if (j->has_hasher)
        pthread_join(j->hasher, NULL); /* it stops once it sees released */
    pthread_mutex_lock(&j->mu);
    long left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left == 0)
        rf_hjob_free(j);
}
