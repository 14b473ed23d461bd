/* Fabric helpers: what Python cannot do through cffi alone (libfabric's calls are static inline
 * functions and its fi_info strings are freed by libfabric), and the completion-queue loops used
 * where no progress core runs. */
#include <string.h>

#include "rf_internal.h"

_Static_assert(sizeof(((struct rf_op *)0)->seg) / sizeof(struct rf_seg) == RF_MAX_SEGS, "rf_op.seg holds RF_MAX_SEGS");

uint32_t rf_api_version(void) { return FI_VERSION(1, 9); }
/* fi_freeinfo frees the provider name, so it must live on the C heap. */
int rf_set_prov_name(struct fi_info *hints, const char *name) {
    hints->fabric_attr->prov_name = strdup(name);
    return hints->fabric_attr->prov_name ? 0 : -1;
}

/* Post ops[0..n) in order. Returns how many were posted; *err is 0 when all were, else the
 * (negative) return of ops[result] (-FI_EAGAIN: queue full or still connecting; retry later).
 * Plain reads and writes use fi_read/fi_write(data); a write that gathers segments or needs
 * delivery-complete goes through fi_writemsg (the provider copies the iov arrays when it posts). */
long rf_post_ops(struct fid_ep *ep, struct rf_op *ops, long n, long *err) {
    struct fi_msg_rma msg;
    struct iovec iov[RF_MAX_SEGS];
    struct fi_rma_iov riov[RF_MAX_SEGS];
    void *desc[RF_MAX_SEGS];
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = iov;
    msg.desc = desc;
    msg.rma_iov = riov;
    for (long i = 0; i < n; i++) {
        struct rf_op *o = &ops[i];
        void *buf = (void *)(uintptr_t)o->buf;
        void *ctx = (void *)(uintptr_t)o->ctx;
        int gather = o->kind == RF_KIND_WRITE && o->nseg >= 2 && o->nseg <= RF_MAX_SEGS;
        ssize_t ret;
        if (o->kind == RF_KIND_READ) {
            ret = fi_read(ep, buf, o->len, o->desc, o->peer, o->raddr, o->key, ctx);
        } else if (gather || (o->flags & 2)) {
            uint64_t fl = FI_COMPLETION;
            size_t count = gather ? (size_t)o->nseg : 1, rcount = 0;
            for (size_t s = 0; s < count; s++) {
                uint64_t raddr = gather ? o->seg[s].raddr : o->raddr;
                iov[s].iov_base = gather ? (void *)(uintptr_t)o->seg[s].buf : buf;
                iov[s].iov_len = gather ? o->seg[s].len : o->len;
                desc[s] = o->desc;
                /* remote pieces that follow each other are one remote iov (shm: one iov keeps the
                 * direct copy path; tcp: a shorter header) */
                if (rcount && riov[rcount - 1].addr + riov[rcount - 1].len == raddr) {
                    riov[rcount - 1].len += iov[s].iov_len;
                    continue;
                }
                riov[rcount].addr = raddr;
                riov[rcount].len = iov[s].iov_len;
                riov[rcount].key = o->key;
                rcount++;
            }
            msg.iov_count = count;
            msg.rma_iov_count = rcount;
            msg.addr = o->peer;
            msg.context = ctx;
            msg.data = 0;
            if (o->flags & 2)
                fl |= FI_DELIVERY_COMPLETE;
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
long rf_cq_drain(struct fid_cq *cq, struct fi_cq_data_entry *ents, long max, uint64_t *out) {
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
long rf_cq_wait(struct fid_cq *cq, struct fi_cq_data_entry *ents, long max, uint64_t *out,
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
