"""cffi API-mode build of the libfabric binding (run by setup.py; most fi_* calls are static inline).

Headers and library are found with `pkg-config libfabric`, or under the prefix named by
RFORK_LIBFABRIC_PREFIX (e.g. /opt/amazon/efa for AWS's EFA installer).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from typing import NamedTuple

from cffi import FFI


class NativePaths(NamedTuple):
    """Compiler and linker search paths (a NamedTuple: cffi execs this file outside sys.modules)."""

    include_dirs: list[str]
    library_dirs: list[str]


def find_libfabric() -> NativePaths | None:
    """Where libfabric's headers and library live, or None when they cannot be found."""
    prefix = os.environ.get("RFORK_LIBFABRIC_PREFIX")
    if prefix:
        inc = os.path.join(prefix, "include")
        if os.path.exists(os.path.join(inc, "rdma", "fabric.h")):
            libdirs = [d for d in (os.path.join(prefix, "lib"), os.path.join(prefix, "lib64"))
                       if os.path.isdir(d)]
            return NativePaths([inc], libdirs)
        return None
    return pkg_config_paths("libfabric")


def pkg_config_paths(package: str) -> NativePaths | None:
    """The include and library directories pkg-config gives for package, or None without them."""
    try:
        cflags = subprocess.run(["pkg-config", "--cflags-only-I", package], check=True,
                                capture_output=True, text=True).stdout
        libs = subprocess.run(["pkg-config", "--libs-only-L", package], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return NativePaths([f[2:] for f in shlex.split(cflags) if f.startswith("-I")],
                       [f[2:] for f in shlex.split(libs) if f.startswith("-L")])


CDEF = """
#define FI_MSG ...
#define FI_RMA ...
#define FI_READ ...
#define FI_WRITE ...
#define FI_RECV ...
#define FI_SEND ...
#define FI_REMOTE_READ ...
#define FI_REMOTE_WRITE ...
#define FI_REMOTE_CQ_DATA ...
#define FI_SOURCE ...
#define FI_COMPLETION ...
#define FI_DELIVERY_COMPLETE ...
#define FI_MR_LOCAL ...
#define FI_MR_VIRT_ADDR ...
#define FI_MR_ALLOCATED ...
#define FI_MR_PROV_KEY ...
#define FI_MR_ENDPOINT ...
#define FI_MR_RAW ...
#define FI_EAGAIN ...
#define FI_EAVAIL ...
#define FI_ETIMEDOUT ...
#define FI_ENODATA ...
#define FI_ECANCELED ...
#define FI_EP_RDM ...
#define FI_AV_TABLE ...
#define FI_CQ_FORMAT_DATA ...
#define FI_WAIT_NONE ...
#define FI_WAIT_UNSPEC ...
#define FI_WAIT_FD ...
#define FI_THREAD_SAFE ...
#define FI_THREAD_DOMAIN ...
#define FI_PROGRESS_MANUAL ...
#define FI_TRANSMIT ...
#define FI_RECV_FLAG ...

typedef uint64_t fi_addr_t;
struct fid { ...; };
struct fid_fabric { struct fid fid; ...; };
struct fid_domain { struct fid fid; ...; };
struct fid_ep { struct fid fid; ...; };
struct fid_cq { struct fid fid; ...; };
struct fid_av { struct fid fid; ...; };
struct fid_mr { struct fid fid; ...; };

struct fi_tx_attr { uint64_t caps; uint64_t mode; uint64_t op_flags; uint64_t msg_order; size_t size;
                    size_t iov_limit; ...; };
struct fi_rx_attr { uint64_t caps; uint64_t mode; uint64_t op_flags; size_t size; ...; };
struct fi_ep_attr { int type; size_t max_msg_size; ...; };
struct fi_domain_attr { char *name; int threading; int control_progress; int data_progress;
                        int mr_mode; size_t mr_key_size; size_t cq_data_size; size_t max_ep_tx_ctx; ...; };
struct fi_fabric_attr { char *name; char *prov_name; ...; };
struct fi_info {
    struct fi_info *next; uint64_t caps; uint64_t mode; uint32_t addr_format;
    size_t src_addrlen; size_t dest_addrlen; void *src_addr; void *dest_addr;
    struct fi_tx_attr *tx_attr; struct fi_rx_attr *rx_attr; struct fi_ep_attr *ep_attr;
    struct fi_domain_attr *domain_attr; struct fi_fabric_attr *fabric_attr; ...;
};
struct fi_cq_attr { size_t size; uint64_t flags; int format; int wait_obj; ...; };
struct fi_av_attr { int type; size_t count; ...; };
struct fi_cq_data_entry { void *op_context; uint64_t flags; size_t len; void *buf; uint64_t data; };
struct fi_cq_err_entry { void *op_context; uint64_t flags; size_t len; void *buf; uint64_t data;
                         uint64_t tag; size_t olen; int err; int prov_errno; void *err_data;
                         size_t err_data_size; };
struct iovec { void *iov_base; size_t iov_len; };
struct fi_rma_iov { uint64_t addr; size_t len; uint64_t key; };
struct fi_msg_rma { const struct iovec *msg_iov; void **desc; size_t iov_count; fi_addr_t addr;
                    const struct fi_rma_iov *rma_iov; size_t rma_iov_count; void *context;
                    uint64_t data; };

uint32_t fi_version(void);
uint32_t rf_api_version(void);
struct fi_info *fi_allocinfo(void);
void fi_freeinfo(struct fi_info *info);
int fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
               const struct fi_info *hints, struct fi_info **info);
const char *fi_strerror(int errnum);
int rf_set_prov_name(struct fi_info *hints, const char *name);
int fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context);
int fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context);
int fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context);
int fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context);
int fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int fi_enable(struct fid_ep *ep);
int fi_getname(struct fid *fid, void *addr, size_t *addrlen);
int fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags,
                 void *context);
const char *fi_av_straddr(struct fid_av *av, const void *addr, char *buf, size_t *len);
int fi_close(struct fid *fid);
int fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
              uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context);
int fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int fi_mr_enable(struct fid_mr *mr);
uint64_t fi_mr_key(struct fid_mr *mr);
void *fi_mr_desc(struct fid_mr *mr);
ssize_t fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr, uint64_t addr,
                uint64_t key, void *context);
ssize_t fi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr,
                 uint64_t addr, uint64_t key, void *context);
ssize_t fi_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
                     fi_addr_t dest_addr, uint64_t addr, uint64_t key, void *context);
ssize_t fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t fi_send(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr,
                void *context);
ssize_t fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr, void *context);
ssize_t fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
ssize_t fi_cq_sread(struct fid_cq *cq, void *buf, size_t count, const void *cond, int timeout);
int fi_cq_signal(struct fid_cq *cq);
const char *fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len);

/* Hot loops in C (cffi releases the GIL during these calls). */
struct rf_op { uint64_t buf; size_t len; void *desc; uint64_t peer; uint64_t raddr; uint64_t key;
               uint64_t ctx; uint64_t data; int kind; int flags; uint64_t group; uint64_t hjob; };
long rf_cq_drain(struct fid_cq *cq, struct fi_cq_data_entry *ents, long max, uint64_t *out);
long rf_cq_wait(struct fid_cq *cq, struct fi_cq_data_entry *ents, long max, uint64_t *out, int timeout_ms);

/* The native progress core: one pthread per domain (see the SOURCE below). */
struct rf_rec { uint64_t ctx; uint64_t flags; uint64_t len; uint64_t data; int64_t err; char msg[120]; };
struct rf_core;
struct rf_core *rf_core_new(struct fid_ep *ep, struct fid_cq *cq, int can_wait, long max_inflight);
int rf_core_start(struct rf_core *c);
long rf_core_submit(struct rf_core *c, struct rf_op *ops, long n);
long rf_core_drain(struct rf_core *c, struct rf_rec *out, long max, int timeout_us);
long rf_core_cancel(struct rf_core *c, uint64_t peer, uint64_t group);
void rf_core_stop(struct rf_core *c);
void rf_core_free(struct rf_core *c);
#define RF_KIND_READ ...
#define RF_KIND_WRITE ...
#define RF_KIND_SEND ...
#define RF_KIND_RECV ...
#define RF_POST_FAILED ...
#define RF_RECV_BASE ...

/* Digest jobs: xxh3-128 of destination spans, hashed by the job's own thread as reads land. */
struct rf_hjob;
int rf_hjob_supported(void);
struct rf_hjob *rf_hjob_new(long nregions, const uint64_t *bases, const uint64_t *sizes, const long *nreads,
                            const uint64_t *reads, const long *nspans, const uint64_t *spans);
int rf_hjob_wait(struct rf_hjob *j, int timeout_ms);
long rf_hjob_digests(struct rf_hjob *j, unsigned char *out, long nspans);
uint64_t rf_hjob_hash_ns(struct rf_hjob *j);
void rf_hjob_landed(struct rf_hjob *j, uint64_t addr, uint64_t len);
void rf_hjob_release(struct rf_hjob *j);
"""

SOURCE = """
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_errno.h>
#define FI_RECV_FLAG FI_RECV
static uint32_t rf_api_version(void) { return FI_VERSION(1, 9); }
/* fi_freeinfo frees the provider name, so it must live on the C heap. */
static int rf_set_prov_name(struct fi_info *hints, const char *name) {
    hints->fabric_attr->prov_name = strdup(name);
    return hints->fabric_attr->prov_name ? 0 : -1;
}

/* One op to post: kind 0 = read, 1 = write (2 = send, 3 = receive: the core only); flags bit 0 =
 * carries data (imm), bit 1 = delivery complete; group = the op it is part of (for cancelling);
 * hjob = a digest job (struct rf_hjob *) to feed the bytes of a read to when it lands, or 0.
 * buf and ctx are integers so that Python fills the array without pointer casts. */
struct rf_op { uint64_t buf; size_t len; void *desc; uint64_t peer; uint64_t raddr; uint64_t key;
               uint64_t ctx; uint64_t data; int kind; int flags; uint64_t group; uint64_t hjob; };

/* Post ops[0..n) in order. Returns how many were posted; *err is 0 when all were, else the
 * (negative) return of ops[result] (-FI_EAGAIN: queue full or still connecting; retry later). */
static long rf_post_ops(struct fid_ep *ep, struct rf_op *ops, long n, long *err) {
    struct fi_msg_rma msg;
    struct iovec iov;
    struct fi_rma_iov riov;
    void *desc;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.rma_iov = &riov;
    msg.rma_iov_count = 1;
    for (long i = 0; i < n; i++) {
        struct rf_op *o = &ops[i];
        void *buf = (void *)(uintptr_t)o->buf;
        void *ctx = (void *)(uintptr_t)o->ctx;
        ssize_t ret;
        if (o->kind == 0) {
            ret = fi_read(ep, buf, o->len, o->desc, o->peer, o->raddr, o->key, ctx);
        } else if (o->flags & 2) {
            uint64_t fl = FI_COMPLETION | FI_DELIVERY_COMPLETE;
            iov.iov_base = buf;
            iov.iov_len = o->len;
            desc = o->desc;
            msg.addr = o->peer;
            riov.addr = o->raddr;
            riov.len = o->len;
            riov.key = o->key;
            msg.context = ctx;
            msg.data = 0;
            if (o->flags & 1) {
                msg.data = o->data;
                fl |= FI_REMOTE_CQ_DATA;
            }
            ret = fi_writemsg(ep, &msg, fl);
        } else if (o->flags & 1) {
            ret = fi_writedata(ep, buf, o->len, o->desc, o->data, o->peer, o->raddr, o->key, ctx);
        } else {
            ret = fi_write(ep, buf, o->len, o->desc, o->peer, o->raddr, o->key, ctx);
        }
        if (ret != 0) {
            *err = (long)ret;
            return i;
        }
    }
    *err = 0;
    return n;
}

static long rf_copy_out(struct fi_cq_data_entry *ents, long n, uint64_t *out) {
    for (long i = 0; i < n; i++) {
        out[4 * i] = (uint64_t)(uintptr_t)ents[i].op_context;
        out[4 * i + 1] = ents[i].flags;
        out[4 * i + 2] = ents[i].len;
        out[4 * i + 3] = ents[i].data;
    }
    return n;
}

/* Read up to max completions (context, flags, len, data per entry into out). Returns the count,
 * 0 when none, or a negative error (-FI_EAVAIL: an error entry waits for fi_cq_readerr) when the
 * first read fails. */
static long rf_cq_drain(struct fid_cq *cq, struct fi_cq_data_entry *ents, long max, uint64_t *out) {
    long total = 0;
    while (total < max) {
        ssize_t n = fi_cq_read(cq, ents + total, (size_t)(max - total));
        if (n <= 0) {
            if (total == 0 && n != -FI_EAGAIN)
                return (long)n;
            break;
        }
        total += n;
    }
    return rf_copy_out(ents, total, out);
}

/* fi_cq_sread for up to timeout_ms, then drain whatever else is ready; same results as drain. */
static long rf_cq_wait(struct fid_cq *cq, struct fi_cq_data_entry *ents, long max, uint64_t *out,
                       int timeout_ms) {
    ssize_t n = fi_cq_sread(cq, ents, (size_t)max, NULL, timeout_ms);
    if (n <= 0)
        return n == -FI_EAVAIL ? (long)n : 0;
    long total = n;
    while (total < max) {
        ssize_t m = fi_cq_read(cq, ents + total, (size_t)(max - total));
        if (m <= 0)
            break;
        total += m;
    }
    return rf_copy_out(ents, total, out);
}

/* ---- The native progress core --------------------------------------------------------------------
 * One pthread per domain owns its endpoint: it posts ops from a submission queue, polls the CQ and
 * appends one record per completion (or failed post) to a completion queue, which Python drains in
 * batches (rf_core_drain blocks without the GIL: cffi releases it). Idle, it busy-polls briefly, then
 * sleeps on the CQ's wait object (fi_cq_sread; submitters wake it with fi_cq_signal) or, where the
 * provider has none usable (shm), on a condition variable with a short timeout, so the passive side
 * keeps serving peers. Python keeps the op bookkeeping (futures, pinned regions, deadlines). */
#include <pthread.h>
#include <errno.h>
#include <stdio.h>
#include <sched.h>
#include <time.h>

/* ---- Digest jobs ----------------------------------------------------------------------------------
 * A pull's digest plan: per destination region its reads (offset, length: sorted, disjoint) and its
 * spans (offset, end: sorted by offset, may overlap). A core thread that reaps a read tagged with a
 * job (rf_op.hjob) calls rf_hjob_landed, which only records it; once every read below some offset has
 * landed, the bytes there are final and the job's own hasher thread feeds them, in address order, to
 * each span's streaming xxh3-128 state, right after they landed. Hashing off the core thread lets the
 * core go on posting and receiving meanwhile: on shm the core does the copy and a second core is
 * otherwise idle (where the thread cannot be started, the landing thread hashes, one at a time). The
 * job lives until Python released it (which joins the hasher) and no queued or posted op refers to it
 * any more; once released it hashes nothing (the destination may be gone). */
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

static long rf_now_ns(void);

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

static void rf_hjob_ref(struct rf_hjob *j) {
    pthread_mutex_lock(&j->mu);
    j->refs++;
    pthread_mutex_unlock(&j->mu);
}

static void rf_hjob_unref(struct rf_hjob *j) {
    pthread_mutex_lock(&j->mu);
    long left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left == 0)
        rf_hjob_free(j);
}

/* Mark the job as unusable (an op could not be tracked): rf_hjob_wait then says so. */
static void rf_hjob_fail(struct rf_hjob *j) {
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

#define RF_KIND_READ 0
#define RF_KIND_WRITE 1
#define RF_KIND_SEND 2
#define RF_KIND_RECV 3
#define RF_POST_FAILED (1ULL << 63) /* record flag: the post itself failed (msg says why) */
#define RF_RECV_BASE (1ULL << 48)   /* contexts at or above are receive buffers */
#define RF_CQ_BATCH 64
#define RF_SPIN_NS 100000L          /* the core busy-polls this long after its last activity */
#define RF_DRAIN_SPIN_NS 50000L     /* a drainer looks this long before it sleeps on the condvar */
#define RF_HTAB 128                 /* posted ops tagged with a digest job (at most max_inflight <= 64) */

struct rf_hslot { uint64_t ctx; struct rf_hjob *job; uint64_t buf, len; };

struct rf_rec { uint64_t ctx; uint64_t flags; uint64_t len; uint64_t data; int64_t err; char msg[120]; };

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
};

static long rf_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

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

/* Append n records (under mu), waking drainers. */
static void rf_emit(struct rf_core *c, struct rf_rec *recs, long n) {
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

/* Queue ops for posting (any thread). Returns n, or -1 when out of memory or stopped. */
long rf_core_submit(struct rf_core *c, struct rf_op *ops, long n) {
    pthread_mutex_lock(&c->mu);
    if (c->stop) {
        pthread_mutex_unlock(&c->mu);
        return -1;
    }
    while (c->sq_len + n > c->sq_cap)
        if (rf_grow((void **)&c->sq, &c->sq_head, c->sq_len, &c->sq_cap, sizeof *ops) != 0) {
            pthread_mutex_unlock(&c->mu);
            return -1;
        }
    for (long i = 0; i < n; i++) {
        c->sq[(c->sq_head + c->sq_len + i) % c->sq_cap] = ops[i];
        if (ops[i].hjob)
            rf_hjob_ref((struct rf_hjob *)(uintptr_t)ops[i].hjob);
    }
    c->sq_len += n;
    if (c->sleeping) {
        if (c->can_wait)
            fi_cq_signal(c->cq);
        else
            pthread_cond_signal(&c->work_cv);
    }
    pthread_mutex_unlock(&c->mu);
    return n;
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
    free(c);
}
"""

def find_xxhash() -> NativePaths | None:
    """Where xxHash's header and library live (Debian: libxxhash-dev), or None: the binding then
    builds without native digests (rf_hjob_supported() is 0) and pulls hash in Python."""
    return pkg_config_paths("libxxhash")


ffibuilder = FFI()
ffibuilder.cdef(CDEF)
_paths = find_libfabric()
_xxh = find_xxhash()
ffibuilder.set_source(
    "backends.providers._libfabric",
    ("#define RF_HAVE_XXHASH 1\n" if _xxh else "") + SOURCE,
    libraries=["fabric", "pthread"] + (["xxhash"] if _xxh else []),
    include_dirs=(_paths.include_dirs if _paths else []) + (_xxh.include_dirs if _xxh else []),
    library_dirs=(_paths.library_dirs if _paths else []) + (_xxh.library_dirs if _xxh else []),
    runtime_library_dirs=_paths.library_dirs if _paths else [],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
