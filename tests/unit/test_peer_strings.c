/*
 * Peer information arrives from other processes (through the caller's allgather when the init
 * takes callbacks): a host name or node id that does not end inside its field must fail the init
 * with EPX_ERR_BOOTSTRAP, never be read past its end. One rank whose allgather corrupts its own
 * block stands in for a corrupt exchange; an honest allgather still initialises.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "core/internal.h"
#include "epx_test.h"

typedef struct corrupt {
    size_t field; /* offset in epx_peer_info_t of the string to fill, or (size_t)-1 for none */
    size_t len;
    int seen;     /* the peer-information exchange went through the callback */
    int domain;   /* overwrite the domain-agreement word (the 4-byte exchange) with INT32_MIN */
} corrupt_t;

static int allgather(void *vctx, const void *send, void *recv, size_t bytes)
{
    corrupt_t *c = vctx;
    memcpy(recv, send, bytes);
    if (bytes == sizeof(epx_peer_info_t)) {
        c->seen = 1;
        if (c->field != (size_t)-1) memset((char *)recv + c->field, 'A', c->len);
    }
    if (bytes == sizeof(int32_t) && c->domain) {
        const int32_t worst = INT32_MIN; /* negated, it overflowed */
        memcpy(recv, &worst, sizeof(worst));
    }
    return 0;
}

static int barrier(void *vctx)
{
    (void)vctx;
    return 0;
}

/* The domain word, the most negative int32: an error, no signed overflow (UBSan builds abort on one). */
static int corrupt_domain_word(void)
{
    corrupt_t c = {(size_t)-1, 0, 0, 1};
    epx_bootstrap_callbacks_t cb = {allgather, barrier, &c};
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_HOST;
    epx_comm_t comm = NULL;
    EXPECT_RES(epx_comm_init_callbacks(&cb, 0, 1, &cfg, &comm), EPX_ERR_REMOTE);
    EXPECT_MSG_HAS("failed its topology checks");
    EXPECT_TRUE(comm == NULL);
    return 0;
}

static int init_with(size_t field, size_t len, epx_result_t expected)
{
    corrupt_t c = {field, len, 0, 0};
    epx_bootstrap_callbacks_t cb = {allgather, barrier, &c};
    epx_comm_config_t cfg = EPX_COMM_CONFIG_INIT;
    cfg.backend = EPX_BACKEND_HOST;
    epx_comm_t comm = NULL;
    EXPECT_RES(epx_comm_init_callbacks(&cb, 0, 1, &cfg, &comm), expected);
    EXPECT_TRUE(c.seen);
    if (expected != EPX_SUCCESS) {
        EXPECT_TRUE(comm == NULL);
        EXPECT_TRUE(strstr(epx_last_error_message(), "not a terminated string") != NULL);
    }
    EXPECT_OK(epx_comm_destroy(comm));
    return 0;
}

int main(void)
{
    const epx_peer_info_t *p = NULL;
    if (init_with((size_t)-1, 0, EPX_SUCCESS)) return 1;
    if (init_with(offsetof(epx_peer_info_t, node_id), sizeof(p->node_id), EPX_ERR_BOOTSTRAP)) return 1;
    if (init_with(offsetof(epx_peer_info_t, hostname), sizeof(p->hostname), EPX_ERR_BOOTSTRAP)) return 1;
    /* One byte short of the field: still a string, still accepted. */
    if (init_with(offsetof(epx_peer_info_t, node_id), sizeof(p->node_id) - 1, EPX_SUCCESS)) return 1;
    if (corrupt_domain_word()) return 1;
    printf("peer strings: corrupt host name and node id refused, honest ones accepted\n");
    return 0;
}
