/*
 * Peer processes of a buffer (either backend): one pidfd per peer, opened at buffer creation, tells
 * that a peer exited even while nobody has reaped it (kill(pid, 0) still succeeds on a zombie).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/internal.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

epx_result_t epx_peers_open(epx_peers_t *peers, epx_comm_t comm)
{
    peers->nranks = comm->nranks;
    peers->pidfd = malloc((size_t)comm->nranks * sizeof(int));
    peers->pid = malloc((size_t)comm->nranks * sizeof(int32_t));
    if (!peers->pidfd || !peers->pid) {
        epx_peers_close(peers);
        return epx_error(EPX_ERR_OUT_OF_MEMORY, "rank %d: cannot allocate %d peer pidfds", comm->rank,
                         comm->nranks);
    }
    for (int r = 0; r < comm->nranks; r++) {
        /* A peer on another host (a domain that spans hosts) has a pid of another machine: not watched
         * here (pid 0: never seen exited; its death reaches us through the device's fail words). */
        peers->pid[r] = comm->peers[r].host_hash == comm->peers[comm->rank].host_hash ? comm->peers[r].pid : 0;
        peers->pidfd[r] = -1;
        /* pidfds are close-on-exec. Without them (old kernels, seccomp) epx_peer_exited reads
         * /proc instead; a peer already gone (ESRCH) is found dead there too. */
        if (r != comm->rank && peers->pid[r] > 0)
            peers->pidfd[r] = (int)syscall(SYS_pidfd_open, (pid_t)peers->pid[r], 0u);
    }
    return EPX_SUCCESS;
}

void epx_peers_close(epx_peers_t *peers)
{
    for (int r = 0; peers->pidfd && r < peers->nranks; r++)
        if (peers->pidfd[r] >= 0) close(peers->pidfd[r]);
    free(peers->pidfd);
    free(peers->pid);
    peers->pidfd = NULL;
    peers->pid = NULL;
    peers->nranks = 0;
}

/* The process state letter from /proc/<pid>/stat; 0 when the process does not exist. */
static char proc_state(int32_t pid)
{
    char path[64], text[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT || errno == ESRCH ? 0 : 'R';
    ssize_t n = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (n <= 0) return 0;
    text[n] = '\0';
    /* The command name may hold spaces and parentheses: the state follows the last ')'. */
    const char *paren = strrchr(text, ')');
    return paren && paren[1] == ' ' ? paren[2] : 'R';
}

int epx_peer_exited(const epx_peers_t *peers, int peer)
{
    if (!peers->pidfd || peer < 0 || peer >= peers->nranks) return 0;
    if (peers->pidfd[peer] >= 0) {
        /* A pidfd becomes readable when the process exits, reaped or not. */
        struct pollfd pfd = {peers->pidfd[peer], POLLIN, 0};
        return poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
    }
    if (peers->pid[peer] <= 0) return 0;
    const char state = proc_state(peers->pid[peer]);
    return state == 0 || state == 'Z' || state == 'X';
}
