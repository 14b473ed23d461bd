/* What the native files share with each other and not with Python (hidden in the built module). */
#ifndef RF_INTERNAL_H
#define RF_INTERNAL_H

#include <time.h>

#include "rf_api.h"

#define RF_INTERNAL __attribute__((visibility("hidden")))

/* fabric.c */
RF_INTERNAL long rf_post_ops(struct fid_ep *ep, struct rf_op *ops, long n, long *err);

/* digest_job.c: the core holds a reference per queued or posted op tagged with a job */
RF_INTERNAL void rf_hjob_ref(struct rf_hjob *j);
RF_INTERNAL void rf_hjob_unref(struct rf_hjob *j);
RF_INTERNAL void rf_hjob_fail(struct rf_hjob *j);

static inline long rf_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

#endif
