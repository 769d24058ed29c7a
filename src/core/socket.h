/*
 * The socket layer under the TCP rendezvous (core/socket.c): listening sockets kept between
 * epx_get_unique_id and rank 0's init, the rendezvous address, and polling bounded by a deadline.
 */
#ifndef EPX_CORE_SOCKET_H
#define EPX_CORE_SOCKET_H

#include <netinet/in.h>

#include "core/internal.h"

/* Keeps the listening socket of the id with `key`, so that rank 0 in this process or a forked
 * child reuses it (the id is usually created before the ranks exist). Kept sockets that were
 * stopped in another process are closed on each visit to the table. */
epx_result_t epx_socket_keep_listener(uint64_t key, int fd);
/* Removes and returns the socket kept for `key`, -1 when this process did not create the id. */
int epx_socket_take_listener(uint64_t key);
/* Stops listening in every process that holds the socket (a forked launcher too) and closes it. */
void epx_socket_stop_listener(int fd);

/* "ip:port" of `sa`. */
void epx_socket_format_addr(const struct sockaddr_in *sa, char *out, size_t cap);
/* 1 when interface `name` is selected by `spec`, an EPX_SOCKET_IFNAME value in NCCL's form:
 * comma-separated name prefixes, "=" first for exact names, "^" first to exclude them. */
int epx_socket_ifname_matches(const char *spec, const char *name);
/* EPX_BOOTSTRAP_ADDR; else, when EPX_SOCKET_IFNAME is set, the first non-loopback IPv4 address it
 * selects (a loopback one when it selects no other); else 127.0.0.1 when the launcher's
 * environment puts the whole job on this node (LOCAL_WORLD_SIZE == WORLD_SIZE,
 * OMPI_COMM_WORLD_LOCAL_SIZE == OMPI_COMM_WORLD_SIZE or SLURM_JOB_NUM_NODES == 1); else the first
 * IPv4 address of an interface not named docker* or lo*; else 127.0.0.1. Port 0 = a free one. */
epx_result_t epx_socket_choose_address(const epx_params_t *params, struct sockaddr_in *sa);
/* Binds and listens on `sa` (its port is updated when 0). */
epx_result_t epx_socket_listen(struct sockaddr_in *sa, int backlog, int *fd_out);

/* Milliseconds left until `deadline` (epx_time_ns), for poll(). */
int epx_socket_remaining_ms(uint64_t deadline);
/* 1: ready, 0: deadline passed, -1: poll failed (errno). */
int epx_socket_poll(int fd, short events, uint64_t deadline);
void epx_socket_set_nodelay(int fd);

#endif /* EPX_CORE_SOCKET_H */
