/*
 * Result strings (from the one X-macro table in epx.h), the per-thread last-error message,
 * and the logger. The public epx_strerror/epx_result_name/epx_last_error_message read these.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"

static _Thread_local char last_message_g[1024];

int epx_log_level_g = EPX_LOG_WARN;
unsigned epx_log_subsys_g = EPX_SUBSYS_ALL;
int epx_log_rank_g = -1;

const char *epx_result_text(epx_result_t result)
{
    switch (result) {
#define EPX_TEXT_CASE_(name, value, text) \
    case EPX_##name: return text;
        EPX_RESULT_MAP(EPX_TEXT_CASE_)
#undef EPX_TEXT_CASE_
    }
    return "unknown result";
}

const char *epx_result_str(epx_result_t result)
{
    switch (result) {
#define EPX_NAME_CASE_(name, value, text)                                                      \
    case EPX_##name:                                                                           \
        return #name;
        EPX_RESULT_MAP(EPX_NAME_CASE_)
#undef EPX_NAME_CASE_
    }
    return "UNKNOWN";
}

bool epx_result_is_failure(int32_t code)
{
    switch (code) {
#define EPX_FAILURE_CASE_(name, value, text) case EPX_##name:
        EPX_RESULT_MAP(EPX_FAILURE_CASE_)
#undef EPX_FAILURE_CASE_
        return code != EPX_SUCCESS;
    }
    return false;
}

const char *epx_error_message(void)
{
    return last_message_g;
}

epx_result_t epx_error(epx_result_t res, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_message_g, sizeof(last_message_g), fmt, ap);
    va_end(ap);
    EPX_LOG(EPX_LOG_WARN, EPX_SUBSYS_ALL, "%s: %s", epx_result_str(res), last_message_g);
    return res;
}

void epx_error_clear(void) { last_message_g[0] = '\0'; }

void epx_error_copy(char *dst, size_t cap)
{
    if (cap == 0) return;
    snprintf(dst, cap, "%s", last_message_g);
}

void epx_error_set_message(const char *msg)
{
    snprintf(last_message_g, sizeof(last_message_g), "%s", msg ? msg : "");
}

void epx_log_write(epx_log_level_t level, unsigned subsys, const char *fmt, ...)
{
    static const char *names[] = {"none", "error", "warn", "info", "trace"};
    char line[1200];
    int n;
    (void)subsys;
    if (epx_log_rank_g >= 0)
        n = snprintf(line, sizeof(line), "epx %s [pid %d rank %d] ", names[level], (int)getpid(),
                     epx_log_rank_g);
    else
        n = snprintf(line, sizeof(line), "epx %s [pid %d] ", names[level], (int)getpid());
    if (n < 0 || n >= (int)sizeof(line)) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line);
}
