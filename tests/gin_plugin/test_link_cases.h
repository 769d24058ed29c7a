/*
 * The link test's cases that run the queue core over the link (test_link_queue.c); test_link.c runs
 * them with its own. Each is one rank's body: 0 on success.
 */
#ifndef EPX_GIN_PLUGIN_TEST_LINK_CASES_H
#define EPX_GIN_PLUGIN_TEST_LINK_CASES_H

#include <stdint.h>

#include "link_fixture.h"

int lt_case_burst(lt_shared_t *sh, int rank, int nranks, uint64_t seed);
int lt_case_dead_teardown(lt_shared_t *sh, int rank, int nranks, uint64_t seed);
int lt_case_queued_teardown(lt_shared_t *sh, int rank, int nranks, uint64_t seed);
int lt_case_failed_put(lt_shared_t *sh, int rank, int nranks, uint64_t seed);

#endif
