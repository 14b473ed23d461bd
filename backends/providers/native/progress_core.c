/* The native progress core.
 *
 * One pthread per domain owns its endpoint: it posts ops from a submission queue, polls the CQ and
 * appends one record per completion (or failed post) to a completion queue, which Python drains in
 * batches (rf_core_drain blocks without the GIL: cffi releases it). Idle, it busy-polls briefly, then
 * sleeps on the CQ's wait object (fi_cq_sread; submitters wake it with fi_cq_signal) or, where the
 * provider has none usable (shm), on a condition variable with a short timeout, so the passive side
 * keeps serving peers. Python keeps the op bookkeeping (futures, pinned regions, deadlines). */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "rf_internal.h"

#define RF_CQ_BATCH 64
#define RF_SPIN_NS 100000L          /* the core busy-polls this long after its last activity */
#define RF_DRAIN_SPIN_NS 50000L     /* a drainer looks this long before it sleeps on the condvar */
#define RF_HTAB 128                 /* posted ops tagged with a digest job (at most max_inflight <= 64) */

struct rf_hslot { uint64_t ctx; struct rf_hjob *job; uint64_t buf, len; };

/* A batch: writes queued under one context (rf_core_submit_batch) that come back as one record,
 * once every one of them completed or failed (the first error is the record's). */
struct rf_batch { uint64_t ctx, len, flags; long left; int64_t err; char msg[120]; };

struct rf_core {
    struct fid_ep *ep;
    struct fid_cq *cq;
    int can_wait;
    long max_inflight;
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* the core sleeps on it where the CQ has no wait object */
    pthread_cond_t done_cv; /* drainers sleep on it */
    struct rf_op *sq; long sq_head, sq_len, sq_cap;
    struct rf_rec *cr; long cr_head, cr_len, cr_cap;
    long inflight; /* posted sends, reads and writes not yet completed */
    int stop, sleeping, drainers, started, joining;
    pthread_t thread;
    struct rf_op batch[64];
    struct fi_cq_data_entry ents[RF_CQ_BATCH];
    struct rf_rec fresh[RF_CQ_BATCH + 64];
    struct rf_hslot htab[RF_HTAB]; /* the core thread's alone: posted tagged ops, by context */
    long hcount;
    struct rf_batch *batches; long nbatches, batches_cap; /* open batches (under mu) */
};

static void rf_deadline_in(struct timespec *ts, long ns) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_nsec += ns;
    ts->tv_sec += ts->tv_nsec / 1000000000L;
    ts->tv_nsec %= 1000000000L;
}

/* Remember a posted op tagged with a digest job (core thread). 0 when the table is full. */
static int rf_htab_put(struct rf_core *c, const struct rf_op *o) {
    for (long i = 0; i < RF_HTAB; i++)
        if (!c->htab[i].job) {
            c->htab[i].ctx = o->ctx;
            c->htab[i].job = (struct rf_hjob *)(uintptr_t)o->hjob;
            c->htab[i].buf = o->buf;
            c->htab[i].len = o->len;
            c->hcount++;
            return 1;
        }
    return 0;
}

/* Take the tagged op with context ctx out of the table (core thread); its slot, or NULL. */
static struct rf_hslot *rf_htab_take(struct rf_core *c, uint64_t ctx, struct rf_hslot *out) {
    if (!c->hcount || !ctx || ctx >= RF_RECV_BASE)
        return NULL;
    for (long i = 0; i < RF_HTAB; i++)
        if (c->htab[i].job && c->htab[i].ctx == ctx) {
            *out = c->htab[i];
            c->htab[i].job = NULL;
            c->hcount--;
            return out;
        }
    return NULL;
}

/* Feed the reads among n fresh CQ entries to their digest jobs (core thread, mu not held, before
 * their records are emitted: a read's future resolves only after its bytes were handed over). */
static void rf_feed_jobs(struct rf_core *c, ssize_t n) {
    struct rf_hslot slot;
    for (ssize_t i = 0; i < n && c->hcount; i++) {
        if (c->ents[i].flags & (FI_REMOTE_WRITE | FI_REMOTE_READ | FI_RECV))
            continue;
        if (rf_htab_take(c, (uint64_t)(uintptr_t)c->ents[i].op_context, &slot)) {
            rf_hjob_landed(slot.job, slot.buf, slot.len);
            rf_hjob_unref(slot.job);
        }
    }
}

/* Double a ring's capacity, moving its items to the front (head becomes 0). */
static int rf_grow(void **buf, long *head, long len, long *cap, size_t item) {
    long ncap = *cap ? *cap * 2 : 256;
    char *nbuf = malloc((size_t)ncap * item);
    if (!nbuf)
        return -1;
    for (long i = 0; i < len; i++)
        memcpy(nbuf + (size_t)i * item, (char *)*buf + (size_t)((*head + i) % *cap) * item, item);
    free(*buf);
    *head = 0;
    *buf = nbuf;
    *cap = ncap;
    return 0;
}

struct rf_core *rf_core_new(struct fid_ep *ep, struct fid_cq *cq, int can_wait, long max_inflight) {
    struct rf_core *c = calloc(1, sizeof *c);
    pthread_condattr_t ca;
    if (!c)
        return NULL;
    c->ep = ep;
    c->cq = cq;
    c->can_wait = can_wait;
    c->max_inflight = max_inflight > 64 ? 64 : max_inflight;
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->work_cv, &ca);
    pthread_cond_init(&c->done_cv, &ca);
    pthread_condattr_destroy(&ca);
    return c;
}

/* Fold the records of batch members into their batches (under mu): a member's record goes, and a
 * batch whose last member ended leaves one record in its place. Returns the records left in recs. */
static long rf_fold_batches(struct rf_core *c, struct rf_rec *recs, long n) {
    long kept = 0;
    for (long i = 0; i < n; i++) {
        struct rf_rec *r = &recs[i];
        long b = -1;
        if (r->ctx && r->ctx < RF_RECV_BASE && !(r->flags & (FI_REMOTE_WRITE | FI_REMOTE_READ | FI_RECV)))
            for (long j = 0; j < c->nbatches; j++)
                if (c->batches[j].ctx == r->ctx) {
                    b = j;
                    break;
                }
        if (b < 0) {
            recs[kept++] = *r;
            continue;
        }
        struct rf_batch *bt = &c->batches[b];
        if (r->err && !bt->err) {
            bt->err = r->err;
            bt->flags = r->flags;
            memcpy(bt->msg, r->msg, sizeof bt->msg);
        }
        if (--bt->left > 0)
            continue;
        struct rf_rec *out = &recs[kept++];
        memset(out, 0, sizeof *out);
        out->ctx = bt->ctx;
        out->flags = bt->flags;
        out->len = bt->len;
        out->err = bt->err;
        memcpy(out->msg, bt->msg, sizeof out->msg);
        c->batches[b] = c->batches[--c->nbatches];
    }
    return kept;
}

/* Append n records (under mu), waking drainers. */
static void rf_emit(struct rf_core *c, struct rf_rec *recs, long n) {
    if (n > 0 && c->nbatches)
        n = rf_fold_batches(c, recs, n);
    if (n <= 0)
        return;
    while (c->cr_len + n > c->cr_cap)
        if (rf_grow((void **)&c->cr, &c->cr_head, c->cr_len, &c->cr_cap, sizeof *recs) != 0)
            return; /* out of memory: completions are lost, their ops time out */
    for (long i = 0; i < n; i++)
        c->cr[(c->cr_head + c->cr_len + i) % c->cr_cap] = recs[i];
    c->cr_len += n;
    if (c->drainers)
        pthread_cond_broadcast(&c->done_cv);
}

static void rf_fail_rec(struct rf_rec *r, const struct rf_op *o, long ret) {
    static const char *names[] = {"fi_read", "fi_write", "fi_send", "fi_recv"};
    memset(r, 0, sizeof *r);
    r->ctx = o->ctx;
    r->flags = RF_POST_FAILED;
    r->err = -ret;
    snprintf(r->msg, sizeof r->msg, "%s failed: %s (%ld)", names[o->kind & 3], fi_strerror((int)-ret), ret);
}

static ssize_t rf_post_one(struct fid_ep *ep, const struct rf_op *o) {
    void *buf = (void *)(uintptr_t)o->buf;
    void *ctx = (void *)(uintptr_t)o->ctx;
    if (o->kind == RF_KIND_SEND)
        return fi_send(ep, buf, o->len, o->desc, o->peer, ctx);
    if (o->kind == RF_KIND_RECV)
        return fi_recv(ep, buf, o->len, o->desc, FI_ADDR_UNSPEC, ctx);
    long err = 0;
    /* reads and writes (with an immediate, delivery complete) */
    long k = rf_post_ops(ep, (struct rf_op *)o, 1, &err);
    return k == 1 ? 0 : (ssize_t)err;
}

/* Put ops back into the queue (mu held): at the front, in order, or at the back. */
static void rf_requeue(struct rf_core *c, const struct rf_op *ops, long n, int front) {
    while (c->sq_len + n > c->sq_cap)
        if (rf_grow((void **)&c->sq, &c->sq_head, c->sq_len, &c->sq_cap, sizeof *ops) != 0)
            return; /* out of memory: these ops are lost and time out */
    for (long j = 0; j < n; j++) {
        if (front) {
            c->sq_head = (c->sq_head + c->sq_cap - 1) % c->sq_cap;
            c->sq[c->sq_head] = ops[n - 1 - j];
        } else {
            c->sq[(c->sq_head + c->sq_len) % c->sq_cap] = ops[j];
        }
        c->sq_len++;
    }
}

/* Post what the queue has room for (mu held on entry and exit). Returns ops posted or failed;
 * *again is set when the provider said EAGAIN. An op refused with EAGAIN while the queue is less
 * than half full (probably its peer is still connecting, or gone) moves to the back of the queue so
 * that ops to other peers go on; otherwise the queue is full and the round ends. */
static long rf_post_some(struct rf_core *c, int *again) {
    long room = c->max_inflight - c->inflight;
    long n = c->sq_len < room ? c->sq_len : room;
    long posted = 0, failed = 0, tx = 0, parked = 0, i;
    struct rf_op park[64];
    *again = 0;
    if (n <= 0)
        return 0;
    for (i = 0; i < n; i++)
        c->batch[i] = c->sq[(c->sq_head + i) % c->sq_cap];
    c->sq_head = (c->sq_head + n) % c->sq_cap;
    c->sq_len -= n;
    pthread_mutex_unlock(&c->mu);
    for (i = 0; i < n; i++) {
        struct rf_op *o = &c->batch[i];
        struct rf_hjob *job = (struct rf_hjob *)(uintptr_t)o->hjob;
        if (job && !rf_htab_put(c, o)) { /* cannot happen while inflight <= 64; never hash wrongly */
            rf_hjob_fail(job);
            rf_hjob_unref(job);
            o->hjob = 0;
            job = NULL;
        }
        ssize_t ret = rf_post_one(c->ep, o);
        if (ret != 0 && job) { /* not posted: forget it again (re-tracked when retried) */
            struct rf_hslot slot;
            rf_htab_take(c, o->ctx, &slot);
            if (ret != -FI_EAGAIN)
                rf_hjob_unref(job);
        }
        if (ret == 0) {
            posted++;
            tx += c->batch[i].kind != RF_KIND_RECV;
        } else if (ret == -FI_EAGAIN) {
            *again = 1;
            if (c->inflight + tx >= c->max_inflight / 2)
                break;
            park[parked++] = c->batch[i];
        } else {
            rf_fail_rec(&c->fresh[failed++], &c->batch[i], (long)ret);
        }
    }
    pthread_mutex_lock(&c->mu);
    c->inflight += tx;
    if (i < n)
        rf_requeue(c, c->batch + i, n - i, 1);
    rf_requeue(c, park, parked, 0);
    rf_emit(c, c->fresh, failed);
    return posted + failed;
}

/* Turn n CQ entries (and an error entry when n == -FI_EAVAIL) into records (mu held). */
static long rf_reap(struct rf_core *c, ssize_t n) {
    long count = 0, tx = 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry err;
        char detail[96];
        memset(&err, 0, sizeof err);
        struct rf_rec *r = &c->fresh[0];
        memset(r, 0, sizeof *r);
        if (fi_cq_readerr(c->cq, &err, 0) < 0) {
            r->err = EIO;
            snprintf(r->msg, sizeof r->msg, "fi_cq_readerr failed");
        } else {
            const char *d = fi_cq_strerror(c->cq, err.prov_errno, err.err_data, detail, sizeof detail);
            struct rf_hslot slot;
            r->ctx = (uint64_t)(uintptr_t)err.op_context;
            if (!(err.flags & (FI_REMOTE_WRITE | FI_REMOTE_READ | FI_RECV)) && rf_htab_take(c, r->ctx, &slot))
                rf_hjob_unref(slot.job); /* a failed read: nothing of it is hashed */
            r->flags = err.flags;
            r->len = err.len;
            r->data = err.data;
            r->err = err.err ? err.err : EIO;
            if (d && *d)
                snprintf(r->msg, sizeof r->msg, "%s; %s", fi_strerror(err.err), d);
            else
                snprintf(r->msg, sizeof r->msg, "%s", fi_strerror(err.err));
        }
        count = 1;
    } else if (n < 0 && n != -FI_EAGAIN) {
        struct rf_rec *r = &c->fresh[0];
        memset(r, 0, sizeof *r);
        r->err = EIO;
        snprintf(r->msg, sizeof r->msg, "fi_cq_read failed: %s (%ld)", fi_strerror((int)-n), (long)n);
        count = 1;
    } else {
        for (ssize_t i = 0; i < n; i++) {
            struct rf_rec *r = &c->fresh[i];
            r->ctx = (uint64_t)(uintptr_t)c->ents[i].op_context;
            r->flags = c->ents[i].flags;
            r->len = c->ents[i].len;
            r->data = c->ents[i].data;
            r->err = 0;
            r->msg[0] = 0;
        }
        count = n > 0 ? n : 0;
    }
    for (long i = 0; i < count; i++) {
        struct rf_rec *r = &c->fresh[i];
        if (r->ctx && r->ctx < RF_RECV_BASE && !(r->flags & (FI_REMOTE_WRITE | FI_REMOTE_READ | FI_RECV)))
            tx++;
    }
    c->inflight = c->inflight > tx ? c->inflight - tx : 0;
    rf_emit(c, c->fresh, count);
    return count;
}

static void *rf_core_main(void *arg) {
    struct rf_core *c = arg;
    long last_busy = rf_now_ns();
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        int again = 0;
        long busy = rf_post_some(c, &again);
        pthread_mutex_unlock(&c->mu);
        ssize_t n = fi_cq_read(c->cq, c->ents, RF_CQ_BATCH);
        rf_feed_jobs(c, n);
        pthread_mutex_lock(&c->mu);
        busy += rf_reap(c, n);
        if (busy) {
            last_busy = rf_now_ns();
            continue;
        }
        if (c->sq_len && !again && c->inflight < c->max_inflight)
            continue;
        long idle_ns = rf_now_ns() - last_busy;
        if (idle_ns < RF_SPIN_NS) {
            pthread_mutex_unlock(&c->mu);
            sched_yield();
            pthread_mutex_lock(&c->mu);
            continue;
        }
        c->sleeping = 1;
        if (c->can_wait) {
            int ms = again ? 1 : (c->inflight ? 10 : 50);
            pthread_mutex_unlock(&c->mu);
            n = fi_cq_sread(c->cq, c->ents, RF_CQ_BATCH, NULL, ms);
            rf_feed_jobs(c, n);
            pthread_mutex_lock(&c->mu);
            c->sleeping = 0;
            if (n > 0 || n == -FI_EAVAIL) {
                rf_reap(c, n);
                last_busy = rf_now_ns();
            }
        } else {
            /* shm: the passive side must poll to serve peers; sleep longer the longer it is idle */
            struct timespec ts;
            long ns = c->inflight || again ? 20000L : (idle_ns / 8 < 200000L ? idle_ns / 8 : 200000L);
            rf_deadline_in(&ts, ns);
            pthread_cond_timedwait(&c->work_cv, &c->mu, &ts);
            c->sleeping = 0;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

int rf_core_start(struct rf_core *c) {
    int rc = pthread_create(&c->thread, NULL, rf_core_main, c);
    if (rc == 0)
        c->started = 1;
    return rc;
}

/* Take mu and make room for n more queued ops: 0 with mu held, or -1 (mu released) when the core
 * stopped or memory ran out. rf_sq_close then counts the n ops written after the queue's end,
 * wakes the core if it sleeps, and releases mu. */
static int rf_sq_open(struct rf_core *c, long n) {
    pthread_mutex_lock(&c->mu);
    if (c->stop) {
        pthread_mutex_unlock(&c->mu);
        return -1;
    }
    while (c->sq_len + n > c->sq_cap)
        if (rf_grow((void **)&c->sq, &c->sq_head, c->sq_len, &c->sq_cap, sizeof *c->sq) != 0) {
            pthread_mutex_unlock(&c->mu);
            return -1;
        }
    return 0;
}

static void rf_sq_close(struct rf_core *c, long n) {
    c->sq_len += n;
    if (c->sleeping) {
        if (c->can_wait)
            fi_cq_signal(c->cq);
        else
            pthread_cond_signal(&c->work_cv);
    }
    pthread_mutex_unlock(&c->mu);
}

/* Queue ops for posting (any thread). Returns n, or -1 when out of memory or stopped. */
long rf_core_submit(struct rf_core *c, struct rf_op *ops, long n) {
    if (rf_sq_open(c, n) != 0)
        return -1;
    for (long i = 0; i < n; i++) {
        c->sq[(c->sq_head + c->sq_len + i) % c->sq_cap] = ops[i];
        if (ops[i].hjob)
            rf_hjob_ref((struct rf_hjob *)(uintptr_t)ops[i].hjob);
    }
    rf_sq_close(c, n);
    return n;
}

/* Group npieces pieces (three integers each: local address, remote address, length) into writes,
 * in order and greedily: a write takes up to max_segs pieces and max_bytes in all, and where the
 * provider does not scatter, only pieces whose remote ends follow each other; a write of several
 * pieces and at most ungathered_upto bytes goes back to one write per piece. groups[i] = the pieces
 * of write i (capacity npieces). Returns the number of writes. */
long rf_group_pieces(const uint64_t *pieces, long npieces, long max_segs, int scatters, uint64_t max_bytes,
                     uint64_t ungathered_upto, uint32_t *groups) {
    long ngroups = 0;
    if (max_segs < 1)
        max_segs = 1;
    if (max_segs > RF_MAX_SEGS)
        max_segs = RF_MAX_SEGS;
    for (long i = 0; i < npieces;) {
        long g = 1;
        uint64_t total = pieces[3 * i + 2], remote_end = pieces[3 * i + 1] + pieces[3 * i + 2];
        while (g < max_segs && i + g < npieces) {
            const uint64_t *p = &pieces[3 * (i + g)];
            if (total + p[2] > max_bytes || (!scatters && p[1] != remote_end))
                break;
            total += p[2];
            remote_end = p[1] + p[2];
            g++;
        }
        if (g > 1 && total <= ungathered_upto)
            for (long j = 0; j < g; j++)
                groups[ngroups++] = 1;
        else
            groups[ngroups++] = (uint32_t)g;
        i += g;
    }
    return ngroups;
}

/* Queue a batch of writes under tmpl's context, which comes back as one record (any thread): the
 * pieces grouped by rf_group_pieces, each write otherwise like tmpl, and a write of at most dc_upto
 * bytes delivery-complete. Returns the number of writes; -1 when out of memory or stopped, -2 when
 * the batch is malformed (empty, not a write, an immediate, a digest job, or a receive context). */
long rf_core_submit_batch(struct rf_core *c, const struct rf_op *tmpl, const uint64_t *pieces, long npieces,
                          long max_segs, int scatters, uint64_t max_bytes, uint64_t ungathered_upto,
                          uint64_t dc_upto) {
    if (npieces <= 0 || tmpl->kind != RF_KIND_WRITE || (tmpl->flags & 1) || tmpl->hjob || !tmpl->ctx
        || tmpl->ctx >= RF_RECV_BASE)
        return -2;
    uint32_t *groups = malloc((size_t)npieces * sizeof *groups);
    if (!groups)
        return -1;
    long ngroups = rf_group_pieces(pieces, npieces, max_segs, scatters, max_bytes, ungathered_upto, groups);
    if (rf_sq_open(c, ngroups) != 0) {
        free(groups);
        return -1;
    }
    if (c->nbatches == c->batches_cap) {
        long ncap = c->batches_cap ? c->batches_cap * 2 : 64;
        struct rf_batch *nb = realloc(c->batches, (size_t)ncap * sizeof *nb);
        if (!nb) {
            pthread_mutex_unlock(&c->mu);
            free(groups);
            return -1;
        }
        c->batches = nb;
        c->batches_cap = ncap;
    }
    struct rf_batch *bt = &c->batches[c->nbatches++];
    memset(bt, 0, sizeof *bt);
    bt->ctx = tmpl->ctx;
    bt->left = ngroups;
    const uint64_t *p = pieces;
    for (long i = 0; i < ngroups; i++) {
        struct rf_op m = *tmpl;
        uint32_t g = groups[i];
        m.buf = p[0];
        m.raddr = p[1];
        m.len = 0;
        m.nseg = g > 1 ? (int)g : 0;
        for (uint32_t j = 0; j < g; j++, p += 3) {
            if (g > 1) {
                m.seg[j].buf = p[0];
                m.seg[j].raddr = p[1];
                m.seg[j].len = p[2];
            }
            m.len += p[2];
        }
        if (m.len <= dc_upto)
            m.flags |= 2;
        bt->len += m.len;
        c->sq[(c->sq_head + c->sq_len + i) % c->sq_cap] = m;
    }
    rf_sq_close(c, ngroups);
    free(groups);
    return ngroups;
}

/* Copy up to max records into out, waiting up to timeout_us for the first. Returns the count, or -1
 * once the core stopped and every record was drained. */
long rf_core_drain(struct rf_core *c, struct rf_rec *out, long max, int timeout_us) {
    long n;
    if (timeout_us > 0) { /* a completion due within microseconds costs less than a wake-up */
        long until = rf_now_ns() + RF_DRAIN_SPIN_NS;
        while (!__atomic_load_n(&c->cr_len, __ATOMIC_RELAXED) && !__atomic_load_n(&c->stop, __ATOMIC_RELAXED)
               && rf_now_ns() < until)
            sched_yield();
    }
    pthread_mutex_lock(&c->mu);
    if (c->cr_len == 0 && !c->stop && timeout_us > 0) {
        struct timespec ts;
        rf_deadline_in(&ts, (long)timeout_us * 1000L);
        c->drainers++;
        while (c->cr_len == 0 && !c->stop)
            if (pthread_cond_timedwait(&c->done_cv, &c->mu, &ts) == ETIMEDOUT)
                break;
        c->drainers--;
    }
    n = c->cr_len < max ? c->cr_len : max;
    for (long i = 0; i < n; i++)
        out[i] = c->cr[(c->cr_head + i) % c->cr_cap];
    if (n) {
        c->cr_head = (c->cr_head + n) % c->cr_cap;
        c->cr_len -= n;
    } else if (c->stop && !c->started) {
        n = -1;
    }
    pthread_mutex_unlock(&c->mu);
    return n;
}

/* Take queued (not yet posted) ops out of the queue: those to peer, or with group != 0 those of that
 * group. Each comes back as a record with err ECANCELED. Returns how many. */
long rf_core_cancel(struct rf_core *c, uint64_t peer, uint64_t group) {
    long kept = 0, gone = 0;
    pthread_mutex_lock(&c->mu);
    for (long i = 0; i < c->sq_len; i++) {
        struct rf_op o = c->sq[(c->sq_head + i) % c->sq_cap];
        if (o.kind != RF_KIND_RECV && (group ? o.group == group : o.peer == peer)) {
            struct rf_rec r;
            memset(&r, 0, sizeof r);
            r.ctx = o.ctx;
            r.err = ECANCELED;
            snprintf(r.msg, sizeof r.msg, "cancelled before it was posted");
            rf_emit(c, &r, 1);
            if (o.hjob)
                rf_hjob_unref((struct rf_hjob *)(uintptr_t)o.hjob);
            gone++;
        } else {
            c->sq[(c->sq_head + kept++) % c->sq_cap] = o;
        }
    }
    c->sq_len = kept;
    pthread_mutex_unlock(&c->mu);
    return gone;
}

/* Stop the thread and wait for it (idempotent, from any number of threads at once: one joins, the
 * others wait until it has); queued ops are not posted. Drainers wake. */
void rf_core_stop(struct rf_core *c) {
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    if (c->can_wait && c->started)
        fi_cq_signal(c->cq);
    pthread_cond_broadcast(&c->work_cv);
    pthread_cond_broadcast(&c->done_cv);
    if (c->started && !c->joining) {
        c->joining = 1;
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->thread, NULL);
        pthread_mutex_lock(&c->mu);
        c->started = 0;
        pthread_cond_broadcast(&c->done_cv);
    } else {
        while (c->started)
            pthread_cond_wait(&c->done_cv, &c->mu);
    }
    pthread_mutex_unlock(&c->mu);
}

void rf_core_free(struct rf_core *c) {
    rf_core_stop(c);
    /* ops never posted or never completed drop their hold on digest jobs */
    for (long i = 0; i < c->sq_len; i++) {
        struct rf_op *o = &c->sq[(c->sq_head + i) % c->sq_cap];
        if (o->hjob)
            rf_hjob_unref((struct rf_hjob *)(uintptr_t)o->hjob);
    }
    for (long i = 0; i < RF_HTAB; i++)
        if (c->htab[i].job)
            rf_hjob_unref(c->htab[i].job);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->work_cv);
    pthread_cond_destroy(&c->done_cv);
    free(c->sq);
    free(c->cr);
    free(c->batches);
    free(c);
}
