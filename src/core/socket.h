/*
 * The socket layer under the TCP rendezvous (core/socket.c): listening sockets kept between
 * epx_get_unique_id and rank 0's init, the rendezvous address, and polling bounded by a deadline.
 */
#ifndef EPX_CORE_SOCKET_H
#define EPX_CORE_SOCKET_H

#include <netinet/in.h>

#include "core/internal.h"

/* Keeps the listening socket of the id with `nonce`, so that rank 0 in this process or a forked
 * child reuses it (the id is usually created before the ranks exist). */
epx_result_t epx_socket_keep_listener(uint64_t nonce, int fd);
/* Removes and returns the socket kept for `nonce`, -1 when this process did not create the id. */
int epx_socket_take_listener(uint64_t nonce);

/* "ip:port" of `sa`. */
void epx_socket_format_addr(const struct sockaddr_in *sa, char *out, size_t cap);
/* EPX_BOOTSTRAP_ADDR, else the first IPv4 address of EPX_SOCKET_IFNAME (loopback allowed when
 * named), else the first non-loopback one of any interface, else 127.0.0.1; port 0 = pick a
 * free one. */
epx_result_t epx_socket_choose_address(const epx_params_t *params, struct sockaddr_in *sa);
/* Binds and listens on `sa` (its port is updated when 0). */
epx_result_t epx_socket_listen(struct sockaddr_in *sa, int backlog, int *fd_out);

/* Milliseconds left until `deadline` (epx_time_ns), for poll(). */
int epx_socket_remaining_ms(uint64_t deadline);
/* 1: ready, 0: deadline passed, -1: poll failed (errno). */
int epx_socket_poll(int fd, short events, uint64_t deadline);
void epx_socket_set_nodelay(int fd);

#endif /* EPX_CORE_SOCKET_H */
