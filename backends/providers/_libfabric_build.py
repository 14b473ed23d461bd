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


class LibfabricPaths(NamedTuple):
    """Compiler and linker search paths (a NamedTuple: cffi execs this file outside sys.modules)."""

    include_dirs: list[str]
    library_dirs: list[str]


def find_libfabric() -> LibfabricPaths | None:
    """Where libfabric's headers and library live, or None when they cannot be found."""
    prefix = os.environ.get("RFORK_LIBFABRIC_PREFIX")
    if prefix:
        inc = os.path.join(prefix, "include")
        if os.path.exists(os.path.join(inc, "rdma", "fabric.h")):
            libdirs = [d for d in (os.path.join(prefix, "lib"), os.path.join(prefix, "lib64"))
                       if os.path.isdir(d)]
            return LibfabricPaths([inc], libdirs)
        return None
    try:
        cflags = subprocess.run(["pkg-config", "--cflags-only-I", "libfabric"], check=True,
                                capture_output=True, text=True).stdout
        libs = subprocess.run(["pkg-config", "--libs-only-L", "libfabric"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    incs = [f[2:] for f in shlex.split(cflags) if f.startswith("-I")]
    libdirs = [f[2:] for f in shlex.split(libs) if f.startswith("-L")]
    return LibfabricPaths(incs, libdirs)


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
               uint64_t ctx; uint64_t data; int kind; int flags; };
long rf_post_ops(struct fid_ep *ep, struct rf_op *ops, long n, long *err);
long rf_cq_drain(struct fid_cq *cq, struct fi_cq_data_entry *ents, long max, uint64_t *out);
long rf_cq_wait(struct fid_cq *cq, struct fi_cq_data_entry *ents, long max, uint64_t *out, int timeout_ms);
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

/* One RMA op to post: kind 0 = read, 1 = write; flags bit 0 = carries data (imm), bit 1 = delivery
 * complete. buf and ctx are integers so that Python fills the array without pointer casts. */
struct rf_op { uint64_t buf; size_t len; void *desc; uint64_t peer; uint64_t raddr; uint64_t key;
               uint64_t ctx; uint64_t data; int kind; int flags; };

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
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
_paths = find_libfabric()
ffibuilder.set_source(
    "backends.providers._libfabric",
    SOURCE,
    libraries=["fabric"],
    include_dirs=_paths.include_dirs if _paths else [],
    library_dirs=_paths.library_dirs if _paths else [],
    runtime_library_dirs=_paths.library_dirs if _paths else [],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
