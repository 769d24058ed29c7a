/*
 * What the ranks of one GIN collective communicator of the test plugin share on one host, without
 * CUDA: the listen handle (pid + serial name everything else), a datagram socket per rank in the
 * abstract unix namespace for collective exchanges that may carry a file descriptor (memory
 * registration), and each rank's inbound signal mailbox in POSIX shared memory.
 *
 * Mailbox (one shared segment per receiving rank, one ring per sending rank): the sender owns its
 * ticket counter; it writes a slot's payload, then release-stores the slot's sequence = ticket + 1.
 * The receiver (the only writer of its signal words) polls the slot itself, acquire-loads the
 * sequence, checks it is the ticket it expects, applies the add, and release-stores `applied` =
 * ticket + 1 once the add has landed; a request it refuses is published in `refused` with a reason.
 * Every wait on a peer is bounded by a deadline and checks that the peer process is still alive.
 */
#ifndef EPX_GIN_PLUGIN_LINK_H
#define EPX_GIN_PLUGIN_LINK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define LINK_MAGIC 0x6570786731316c6bull /* "epxg11lk" */

/* The listen handle (NCCL all-gathers GIN11_HANDLE_MAXSIZE bytes of it). */
typedef struct link_handle {
    uint64_t magic;
    int32_t pid;
    uint32_t uid;
    uint64_t serial; /* per process, from listen */
} link_handle_t;

typedef struct link_slot {
    uint64_t seq; /* ticket + 1 once the payload is complete */
    uint64_t region;
    uint64_t offset;
    uint64_t value;
} link_slot_t;

typedef struct link_ring {
    uint64_t applied;     /* receiver: tickets applied, release-stored */
    uint64_t refused;     /* receiver: ticket + 1 of the first refused request, 0 when none */
    uint64_t sender_done; /* sender: 1 once it has closed and posts nothing more */
    uint64_t pad[5];
    char reason[192]; /* receiver: why `refused` */
} link_ring_t;

typedef struct link_mailbox {
    uint64_t magic;
    int32_t nranks;
    int32_t owner_pid;
    uint64_t slots; /* per ring, a power of two */
    uint64_t pad[5];
    /* then nranks link_ring_t, then nranks * slots link_slot_t */
} link_mailbox_t;

/* The serial of connect's second exchange (every rank has mapped every mailbox); registrations count
 * from 1, connect's hello is 0. */
#define LINK_SERIAL_MAPPED UINT64_MAX

/* One message of a collective exchange. */
typedef struct link_msg {
    uint64_t magic;
    uint64_t serial; /* which exchange: 0 for connect, the region serial for registrations */
    int32_t rank;
    int32_t kind; /* user-defined */
    uint64_t words[4];
    unsigned char blob[64];
} link_msg_t;

typedef struct link_peer {
    pid_t pid;
    uint64_t serial;
    link_mailbox_t *mbox; /* its inbound mailbox, mapped here */
    size_t mbox_len;
    uint64_t next_ticket; /* sender side: this rank's next ticket in the peer's mailbox */
    uint64_t expected;    /* receiver side: the next ticket to take from the peer's ring here */
} link_peer_t;

typedef struct link_stash {
    link_msg_t msg;
    int fd;
    struct link_stash *next;
} link_stash_t;

typedef struct link {
    int rank, nranks;
    int sock;              /* this rank's datagram socket, bound at listen */
    uint64_t serial;       /* this rank's listen serial */
    link_peer_t *peers;    /* nranks; [rank] is this rank */
    link_mailbox_t *inbox; /* this rank's inbound mailbox */
    size_t inbox_len;
    char inbox_name[64];
    link_stash_t *stash; /* messages of later exchanges that arrived early */
    uint64_t deadline_ms;
} link_t;

/* listen: binds this rank's socket and fills the handle; -1 with a message on failure. */
int link_listen(link_handle_t *handle, int *sock_out, char *err, size_t err_len);

/* connect: takes over `sock`, checks the handles, creates this rank's mailbox (slots per ring, rounded
 * up to a power of two), exchanges a hello with every peer (bounded by deadline_ms) and maps theirs,
 * then, after a second exchange saying every rank has mapped every mailbox, unlinks its mailbox's name.
 * On failure the link must still be closed (link_close). */
int link_connect(link_t *l, int sock, uint64_t serial, void *const handles[], int nranks, int rank,
                 uint64_t slots, uint64_t deadline_ms, char *err, size_t err_len);

/* Collective: sends `mine` (with fd when fd >= 0) to every peer and receives one message of the same
 * serial from each into all[nranks] (all[rank] = mine); received fds go to fds[] (-1 when none), owned
 * by the caller. Bounded by the link's deadline; a dead peer or the deadline fails it with a message. */
int link_exchange(link_t *l, const link_msg_t *mine, int fd, link_msg_t *all, int *fds, char *err,
                  size_t err_len);

link_ring_t *link_ring(link_mailbox_t *m, int sender);
link_slot_t *link_slot(link_mailbox_t *m, int sender, uint64_t ticket);

/* 1 when the peer's process still runs (an exited process that nobody has reaped yet counts as gone). */
int link_peer_alive(const link_t *l, int peer);

/* The signal-add protocol over the mailboxes. Sender calls come from one thread at a time per link (the
 * queue context's mutex), receiver calls likewise (the mover's mutex); none of them blocks.
 *
 * Sender: posts an add of `value` to the word at (region, offset) of `peer` into its ring in the peer's
 * mailbox; *ticket identifies it. -1 with a message when the ring holds `slots` adds not yet applied. */
int link_add_post(link_t *l, int peer, uint64_t region, uint64_t offset, uint64_t value, uint64_t *ticket,
                  char *err, size_t err_len);
/* Sender: 1 once the peer applied `ticket`, 0 while pending, -1 with a message naming the peer when the
 * peer refused it (or an earlier add of this ring: the ring is then in error) or its process is gone. */
int link_add_poll(link_t *l, int peer, uint64_t ticket, char *err, size_t err_len);
/* Receiver: takes `sender`'s next published add, in ticket order: 0 when none is published; 1 with the
 * slot's payload and ticket; 2 for an add posted after a refused one of that ring, which must not be
 * applied (its sender fails it). Every taken ticket must be published with link_add_applied. */
int link_add_take(link_t *l, int sender, link_slot_t *slot, uint64_t *ticket);
/* Receiver: refuses `ticket` of `sender` with a reason (the first refusal of a ring is kept). */
void link_add_refuse(link_t *l, int sender, uint64_t ticket, const char *why);
/* Receiver: `sender`'s adds up to `ticket` have landed (or were refused); tickets in order. */
void link_add_applied(link_t *l, int sender, uint64_t ticket);
/* Receiver: 1 when no sender has an add published and not yet taken. */
int link_inbox_idle(link_t *l);
/* Tells every peer this rank posts nothing more; 1 once every live peer has said the same. */
void link_mark_sender_done(link_t *l);
int link_peers_done(const link_t *l);

/* Unmaps and unlinks; closes the socket and stashed fds. Safe on a partly connected link. */
void link_close(link_t *l);

uint64_t link_now_ms(void);

#endif
