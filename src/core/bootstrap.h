/*
 * The bootstrap: the collectives a communicator has before any transport exists, over a TCP
 * rendezvous through rank 0 (core/bootstrap.c on the socket layer of core/socket.c) or over the
 * caller's callbacks. Only core/comm.c and the API's epx_get_unique_id reach it.
 */
#ifndef EPX_CORE_BOOTSTRAP_H
#define EPX_CORE_BOOTSTRAP_H

#include "core/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The TCP rendezvous on the wire, here so that tests can play a hostile or broken peer. The unique
 * id carries rank 0's address and a random secret, which never travels: every connection opens with
 * a hello carrying a fresh nonce and a tag (SipHash-2-4 under the secret) over its fields, and rank 0
 * sends nothing to a connection before its hello authenticates. Rank 0's verdict carries a tag over
 * the peer's nonce in turn, and a peer trusts a successful verdict (and what follows on the
 * connection) only when that tag is right: a process that took rank 0's port learns nothing of the
 * secret and cannot pose as rank 0. */
#define EPX_BOOT_ID_MAGIC     0x45505849u /* "EPXI" */
#define EPX_BOOT_HELLO_MAGIC  0x4550584fu /* "EPXO" */
#define EPX_BOOT_SECRET_BYTES 16
/* A connection that has not sent a whole, authenticated hello within this long (or the timeout,
 * when shorter) is dropped; at most this many such connections are held at once. */
#define EPX_BOOT_HELLO_MS    2000
#define EPX_BOOT_PENDING_MAX 64

/* Layout inside epx_unique_id_t. Peers of one job share the byte order (the magic checks it). */
typedef struct {
    uint32_t magic;
    uint32_t addr; /* IPv4, network order */
    uint16_t port; /* network order */
    uint16_t pad[3];
    unsigned char secret[EPX_BOOT_SECRET_BYTES];
} epx_boot_id_t;

#define EPX_BOOT_NONCE_BYTES 16
#define EPX_BOOT_TAG_BYTES   16

typedef struct {
    uint32_t magic;
    int32_t rank;
    int32_t nranks;
    uint32_t pad;
    unsigned char nonce[EPX_BOOT_NONCE_BYTES];
    unsigned char tag[EPX_BOOT_TAG_BYTES]; /* epx_boot_tag(secret, 'H', the fields above) */
} epx_boot_hello_t;

/* Rank 0's verdict: after the rendezvous, and before the gathered array of an allgather. The
 * rendezvous verdict (to a peer that joined or was refused) carries a tag over its status and message,
 * and the peer's rank and hello nonce. */
#define BOOT_REPLY_MAGIC 0x45505852u /* "EPXR" */
typedef struct {
    uint32_t magic;
    int32_t status;
    uint64_t seq;
    char message[240];
    unsigned char tag[EPX_BOOT_TAG_BYTES];
} boot_reply_t;

/* The 16-byte tag of `len` bytes under `secret`, for message kind `kind` ('H' hello, 'V' verdict):
 * two SipHash-2-4 values of (kind, half, data). */
void epx_boot_tag(const unsigned char secret[EPX_BOOT_SECRET_BYTES], char kind, const void *data, size_t len,
                  unsigned char tag_out[EPX_BOOT_TAG_BYTES]);
/* Sets h's tag over its other fields. */
void epx_boot_hello_sign(epx_boot_hello_t *h, const unsigned char secret[EPX_BOOT_SECRET_BYTES]);

/* All are bounded by the communicator's timeout. */
struct epx_bootstrap_ops {
    epx_result_t (*allgather)(void *state, const void *send, void *recv, size_t bytes);
    epx_result_t (*barrier)(void *state);
    void (*close)(void *state); /* never blocks on a peer */
};

/* Binds rank 0's rendezvous socket (kept for a rank 0 in this process or a forked child) and
 * writes the id naming it. */
epx_result_t epx_bootstrap_unique_id(epx_unique_id_t *id_out);
/* TCP rendezvous through rank 0. */
epx_result_t epx_bootstrap_tcp_create(const epx_unique_id_t *id, int rank, int nranks, int64_t timeout_ms,
                                      const epx_bootstrap_ops_t **ops_out, void **state_out);
/* Caller-supplied callbacks. */
epx_result_t epx_bootstrap_callbacks_create(const epx_bootstrap_callbacks_t *callbacks, int rank, int nranks,
                                            const epx_bootstrap_ops_t **ops_out, void **state_out);

#ifdef __cplusplus
}
#endif

#endif /* EPX_CORE_BOOTSTRAP_H */
