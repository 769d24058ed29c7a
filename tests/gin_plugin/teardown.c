/*
 * The test GIN plugin's close sequence (teardown.h): plain C over the queue core and the link.
 */
#include "teardown.h"

#include <stdio.h>
#include <time.h>

static void nap_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

static void serve_once(const gin_server_t *srv, int rank)
{
    char err[256] = "", msg[300];
    if (srv->serve(srv->state, err, sizeof(err)) && srv->warn) {
        snprintf(msg, sizeof(msg), "rank %d: %s", rank, err);
        srv->warn(msg);
    }
}

ginq_result_t gin_teardown(ginq_t *q, link_t *l, const gin_server_t *srv, int rank, int context,
                           uint64_t deadline_ms, char *err, size_t err_len)
{
    uint64_t start = link_now_ms(), end = start + deadline_ms;
    err[0] = '\0';
    /* This rank's operations first: peers keep serving until this rank says it is done. */
    while (link_now_ms() < end) {
        serve_once(srv, rank);
        if (ginq_progress(q) != GINQ_OK || ginq_outstanding(q) == 0) break;
        nap_us(50);
    }
    link_mark_sender_done(l);
    while (link_now_ms() < end && !(link_peers_done(l) && srv->idle(srv->state))) {
        serve_once(srv, rank);
        nap_us(50);
    }
    if (!link_peers_done(l) && srv->warn) {
        char msg[200];
        snprintf(
            msg, sizeof(msg),
            "rank %d: context %d closed before every peer had finished posting signal adds to it (%llu ms)",
            rank, context, (unsigned long long)deadline_ms);
        srv->warn(msg);
    }
    /* The core's messages then count the whole close against the whole deadline, not what was left. */
    ginq_result_t res = ginq_close_after(q, link_now_ms() - start, deadline_ms);
    if (res != GINQ_OK) ginq_message(q, err, err_len);
    return res;
}
