/*
 * The one table of environment variables: name, type, default, help. Parsed once per process;
 * a malformed value is an error that names the variable, reported by every call that needs
 * the parameters until it is fixed.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/internal.h"

typedef enum { PARAM_INT, PARAM_STRING, PARAM_LEVEL, PARAM_SUBSYS, PARAM_BOOL } param_type_t;

typedef struct {
    const char *name;
    param_type_t type;
    const char *default_value;
    int64_t min, max;
    size_t offset; /* into epx_params_t */
    size_t cap;    /* strings */
    const char *help;
    const char *choices; /* strings: the accepted values, comma-separated (NULL: any) */
} param_def_t;

#define P_OFF(field) offsetof(epx_params_t, field)
#define P_CAP(field) sizeof(((epx_params_t *)0)->field)

static const param_def_t param_table[] = {
    {"EPX_TIMEOUT_MS", PARAM_INT, "100000", 1, 86400000, P_OFF(timeout_ms), 8,
     "deadline of every host and device wait, in milliseconds"},
    {"EPX_RANKS_PER_NVLINK_DOMAIN", PARAM_INT, "0", 0, 1 << 20, P_OFF(ranks_per_nvlink_domain), 4,
     "cap on the ranks per NVLink domain (the node; 0 = no cap); must divide the ranks per node"},
    {"EPX_NODE_ID", PARAM_STRING, "", 0, 0, P_OFF(node_id), P_CAP(node_id),
     "this rank's node id (ranks with one id form a node); overrides the comm config's node_id "
     "(default: the host's identity)"},
    {"EPX_HOST_THREADS", PARAM_INT, "0", 0, 256, P_OFF(host_threads), 4,
     "threads per rank for host-backend copies and reductions (0 = automatic)"},
    {"EPX_DEBUG", PARAM_LEVEL, "warn", 0, 4, P_OFF(debug_level), 4,
     "log level: none, error, warn, info, trace"},
    {"EPX_DEBUG_SUBSYS", PARAM_SUBSYS, "all", 0, 0, P_OFF(debug_subsys), 4,
     "comma-separated subsystems to log: init,bootstrap,shm,ipc,ht,ll,permute,api or all"},
    {"EPX_BOOTSTRAP_ADDR", PARAM_STRING, "", 0, 0, P_OFF(bootstrap_addr), P_CAP(bootstrap_addr),
     "ip:port rank 0 listens on for the TCP rendezvous (default: an address of EPX_SOCKET_IFNAME, "
     "free port)"},
    {"EPX_SOCKET_IFNAME", PARAM_STRING, "", 0, 0, P_OFF(socket_ifname), P_CAP(socket_ifname),
     "interfaces the rendezvous may bind, NCCL's form: comma-separated name prefixes, '=' first for "
     "exact names, '^' first to exclude (default: loopback when the launcher puts the job on one "
     "node, else the first interface not named docker* or lo*)"},
    {"EPX_SHM_DIR", PARAM_STRING, "/dev/shm", 0, 0, P_OFF(shm_dir), P_CAP(shm_dir),
     "unused (kept for compatibility): the host backend shares anonymous memory, no files"},
    {"EPX_PRINT_ENV", PARAM_BOOL, "0", 0, 1, P_OFF(print_env), 4,
     "print this table with the values in effect at the first communicator init"},
    {"EPX_CUDA_IPC", PARAM_STRING, "auto", 0, 0, P_OFF(cuda_ipc), P_CAP(cuda_ipc),
     "how the cuda backend shares a buffer between a node's processes: auto (fd where every device "
     "can, else legacy), fd (virtual memory passed as file descriptors), fabric (fabric handles, "
     "multi-node NVLink), legacy (cudaIpc handles)",
     "auto,fd,fabric,legacy"},
    {"EPX_NET_TRANSPORT", PARAM_STRING, "", 0, 0, P_OFF(net_transport), P_CAP(net_transport),
     "the network transport of a cuda-backend LL buffer across nodes: loop (the test transport, every "
     "rank on one machine; the only one this version passes on), gin (NCCL GIN; built with NCCL, not "
     "passing yet: docs/network.md); empty: none (such a buffer is refused, naming this variable)",
     ",loop,gin"},
    {"EPX_NET_LOOP_STRICT", PARAM_BOOL, "0", 0, 1, P_OFF(net_loop_strict), 4,
     "1: the loop transport's strict mode (puts and weak signals land as late and out of order as GIN "
     "allows)"},
};

static pthread_mutex_t params_lock_g = PTHREAD_MUTEX_INITIALIZER;
static epx_params_t params_g;
static int params_ok_g;

static const struct {
    const char *name;
    unsigned bit;
} subsys_names[] = {{"init", EPX_SUBSYS_INIT}, {"bootstrap", EPX_SUBSYS_BOOTSTRAP},
                    {"shm", EPX_SUBSYS_SHM},   {"ipc", EPX_SUBSYS_IPC},
                    {"ht", EPX_SUBSYS_HT},     {"ll", EPX_SUBSYS_LL},
                    {"permute", EPX_SUBSYS_PERMUTE}, {"api", EPX_SUBSYS_API},
                    {"all", EPX_SUBSYS_ALL}};

static epx_result_t parse_one(const param_def_t *def, const char *text, epx_params_t *p)
{
    char *base = (char *)p + def->offset;
    switch (def->type) {
    case PARAM_INT:
    case PARAM_BOOL: {
        char *end = NULL;
        errno = 0;
        long long v = strtoll(text, &end, 10);
        if (errno || end == text || *end != '\0' || v < def->min || v > def->max)
            return epx_error(EPX_ERR_INVALID_ARG, "%s='%s' is not an integer in [%lld, %lld]", def->name,
                             text, (long long)def->min, (long long)def->max);
        if (def->cap == 8)
            *(int64_t *)base = v;
        else
            *(int32_t *)base = (int32_t)v;
        return EPX_SUCCESS;
    }
    case PARAM_STRING:
        if (strlen(text) >= def->cap)
            return epx_error(EPX_ERR_INVALID_ARG, "%s is longer than %zu characters", def->name,
                             def->cap - 1);
        if (def->choices) {
            /* Matched in any case and kept as the list spells it, so readers compare exactly. A leading
             * comma lists the empty value. */
            const size_t n = strlen(text);
            const char *c = def->choices;
            for (;;) {
                const char *end = strchr(c, ',');
                const size_t len = end ? (size_t)(end - c) : strlen(c);
                if (n == len && strncasecmp(c, text, n) == 0) {
                    snprintf(base, def->cap, "%.*s", (int)len, c);
                    return EPX_SUCCESS;
                }
                if (!end) break;
                c = end + 1;
            }
            return epx_error(EPX_ERR_INVALID_ARG, "%s='%s' is not one of %s", def->name, text,
                             def->choices[0] == ',' ? def->choices + 1 : def->choices);
        }
        snprintf(base, def->cap, "%s", text);
        return EPX_SUCCESS;
    case PARAM_LEVEL: {
        static const char *levels[] = {"none", "error", "warn", "info", "trace"};
        for (int i = 0; i < 5; i++)
            if (strcasecmp(text, levels[i]) == 0) {
                *(int32_t *)base = i;
                return EPX_SUCCESS;
            }
        return epx_error(EPX_ERR_INVALID_ARG, "%s='%s' is not one of none, error, warn, info, trace",
                         def->name, text);
    }
    case PARAM_SUBSYS: {
        char copy[256];
        unsigned mask = 0;
        if (strlen(text) >= sizeof(copy))
            return epx_error(EPX_ERR_INVALID_ARG, "%s is too long", def->name);
        snprintf(copy, sizeof(copy), "%s", text);
        char *save = NULL;
        for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            unsigned bit = 0;
            for (size_t i = 0; i < sizeof(subsys_names) / sizeof(subsys_names[0]); i++)
                if (strcasecmp(tok, subsys_names[i].name) == 0) bit = subsys_names[i].bit;
            if (!bit)
                return epx_error(EPX_ERR_INVALID_ARG, "%s names an unknown subsystem '%s'", def->name, tok);
            mask |= bit;
        }
        if (!mask) return epx_error(EPX_ERR_INVALID_ARG, "%s is empty", def->name);
        *(uint32_t *)base = mask;
        return EPX_SUCCESS;
    }
    }
    return epx_error(EPX_ERR_INTERNAL, "unknown parameter type for %s", def->name);
}

static epx_result_t parse_all(epx_params_t *p)
{
    memset(p, 0, sizeof(*p));
    for (size_t i = 0; i < sizeof(param_table) / sizeof(param_table[0]); i++) {
        const param_def_t *def = &param_table[i];
        EPX_CHECK(parse_one(def, def->default_value, p));
        const char *env = getenv(def->name);
        if (env) EPX_CHECK(parse_one(def, env, p));
    }
    return EPX_SUCCESS;
}

epx_result_t epx_params_get(const epx_params_t **params_out)
{
    epx_result_t res = EPX_SUCCESS;
    pthread_mutex_lock(&params_lock_g);
    if (!params_ok_g) {
        epx_params_t p;
        res = parse_all(&p);
        if (res == EPX_SUCCESS) {
            params_g = p;
            params_ok_g = 1;
            epx_log_level_g = p.debug_level;
            epx_log_subsys_g = p.debug_subsys;
        }
    }
    pthread_mutex_unlock(&params_lock_g);
    if (res == EPX_SUCCESS) *params_out = &params_g;
    return res;
}

epx_result_t epx_params_reload(void)
{
    pthread_mutex_lock(&params_lock_g);
    params_ok_g = 0;
    pthread_mutex_unlock(&params_lock_g);
    const epx_params_t *p;
    return epx_params_get(&p);
}

void epx_params_print(void *out)
{
    FILE *f = (FILE *)out;
    const epx_params_t *p = NULL;
    int ok = epx_params_get(&p) == EPX_SUCCESS;
    fprintf(f, "%-30s %-18s %-10s %s\n", "variable", "value", "default", "meaning");
    for (size_t i = 0; i < sizeof(param_table) / sizeof(param_table[0]); i++) {
        const param_def_t *def = &param_table[i];
        const char *env = getenv(def->name);
        fprintf(f, "%-30s %-18s %-10s %s%s\n", def->name, env ? env : "(unset)", def->default_value,
                def->help, (!ok && env) ? " [check value]" : "");
    }
}
