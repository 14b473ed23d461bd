/* What the native module offers Python, beside the libfabric calls that libfabric.cdef names.
 *
 * The build script (backends/providers/_libfabric_build.py) hands this file to cffi's cdef as well:
 * keep it to declarations cffi parses (no function-like macros; every #define here is an integer
 * constant, which Python reads from the compiled value; #include and the guard are skipped).
 * backends/providers/_libfabric.pyi types the same names for mypy; a test checks they agree. */
#ifndef RF_API_H
#define RF_API_H

#include <stdint.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_errno.h>

#define FI_RECV_FLAG FI_RECV

/* ---- Fabric helpers (fabric.c) ---- */
uint32_t rf_api_version(void);
int rf_set_prov_name(struct fi_info *hints, const char *name);

/* One piece of a gathered write: len bytes from local buf to remote raddr (same key). */
#define RF_MAX_SEGS 4
struct rf_seg { uint64_t buf; uint64_t raddr; uint64_t len; };

/* One op to post: kind 0 = read, 1 = write (2 = send, 3 = receive: the core only); flags bit 0 =
 * carries data (imm), bit 1 = delivery complete; group = the op it is part of (for cancelling);
 * hjob = a digest job (struct rf_hjob *) to feed the bytes of a read to when it lands, or 0.
 * A write with nseg >= 2 is one fi_writemsg of seg[0..nseg) (a local and a remote iov each, same
 * desc and key; buf, raddr and len then describe the whole for records), else one span (buf, len).
 * buf and ctx are integers so that Python fills the array without pointer casts. */
struct rf_op { uint64_t buf; size_t len; void *desc; uint64_t peer; uint64_t raddr; uint64_t key;
               uint64_t ctx; uint64_t data; int kind; int flags; uint64_t group; uint64_t hjob;
               int nseg; struct rf_seg seg[4]; }; /* 4: RF_MAX_SEGS (cffi needs the literal) */

/* Hot loops in C (cffi releases the GIL during these calls). */
long rf_cq_drain(struct fid_cq *cq, struct fi_cq_data_entry *ents, long max, uint64_t *out);
long rf_cq_wait(struct fid_cq *cq, struct fi_cq_data_entry *ents, long max, uint64_t *out, int timeout_ms);

/* ---- The native progress core (progress_core.c): one pthread per domain ---- */
#define RF_KIND_READ 0
#define RF_KIND_WRITE 1
#define RF_KIND_SEND 2
#define RF_KIND_RECV 3
#define RF_POST_FAILED (1ULL << 63) /* record flag: the post itself failed (msg says why) */
#define RF_RECV_BASE (1ULL << 48)   /* contexts at or above are receive buffers */

struct rf_rec { uint64_t ctx; uint64_t flags; uint64_t len; uint64_t data; int64_t err; char msg[120]; };
struct rf_core;
struct rf_core *rf_core_new(struct fid_ep *ep, struct fid_cq *cq, int can_wait, long max_inflight);
int rf_core_start(struct rf_core *c);
long rf_core_submit(struct rf_core *c, struct rf_op *ops, long n);
long rf_group_pieces(const uint64_t *pieces, long npieces, long max_segs, int scatters, uint64_t max_bytes,
                     uint64_t ungathered_upto, uint32_t *groups);
long rf_core_submit_batch(struct rf_core *c, const struct rf_op *tmpl, const uint64_t *pieces, long npieces,
                          long max_segs, int scatters, uint64_t max_bytes, uint64_t ungathered_upto,
                          uint64_t dc_upto);
long rf_core_drain(struct rf_core *c, struct rf_rec *out, long max, int timeout_us);
long rf_core_cancel(struct rf_core *c, uint64_t peer, uint64_t group);
void rf_core_stop(struct rf_core *c);
void rf_core_free(struct rf_core *c);

/* ---- Digest jobs (digest_job.c): xxh3-128 of destination spans, hashed by the job's own thread as
 * reads land ---- */
struct rf_hjob;
int rf_hjob_supported(void);
struct rf_hjob *rf_hjob_new(long nregions, const uint64_t *bases, const uint64_t *sizes, const long *nreads,
                            const uint64_t *reads, const long *nspans, const uint64_t *spans);
int rf_hjob_wait(struct rf_hjob *j, int timeout_ms);
long rf_hjob_digests(struct rf_hjob *j, unsigned char *out, long nspans);
uint64_t rf_hjob_hash_ns(struct rf_hjob *j);
void rf_hjob_landed(struct rf_hjob *j, uint64_t addr, uint64_t len);
void rf_hjob_release(struct rf_hjob *j);

#endif
