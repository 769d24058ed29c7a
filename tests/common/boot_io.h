/*
 * What the bootstrap attack tests share: the fields of a unique id, a raw connection to rank 0's
 * rendezvous and a hello that passes its checks.
 */
#ifndef EPX_TEST_BOOT_IO_H
#define EPX_TEST_BOOT_IO_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/bootstrap.h"

static inline epx_boot_id_t boot_id_fields(const epx_unique_id_t *id)
{
    epx_boot_id_t b;
    memcpy(&b, id->internal, sizeof(b));
    return b;
}

/* Rank 0's rendezvous address in an id. */
static inline struct sockaddr_in boot_addr(const epx_unique_id_t *id)
{
    const epx_boot_id_t b = boot_id_fields(id);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = b.addr;
    sa.sin_port = b.port;
    return sa;
}

/* A blocking connection to rank 0's rendezvous address; -1 when refused. */
static inline int boot_connect(const epx_unique_id_t *id)
{
    const struct sockaddr_in sa = boot_addr(id);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) return fd;
    if (fd >= 0) close(fd);
    return -1;
}

/* A hello for `rank` of `nranks` signed with the id's secret (a fixed nonce). */
static inline epx_boot_hello_t boot_hello(const epx_unique_id_t *id, int rank, int nranks)
{
    epx_boot_hello_t h;
    memset(&h, 0, sizeof(h));
    h.magic = EPX_BOOT_HELLO_MAGIC;
    h.rank = rank;
    h.nranks = nranks;
    memset(h.nonce, 0x3c, sizeof(h.nonce));
    epx_boot_hello_sign(&h, boot_id_fields(id).secret);
    return h;
}

#endif
