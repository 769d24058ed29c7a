/*
 * Limits shared by the API checks, both backends and the kernels (plain C, no dependencies, so
 * device code can include it).
 */
#ifndef EPX_CORE_LIMITS_H
#define EPX_CORE_LIMITS_H

/* Largest K (num_topk) a buffer accepts. Device error records encode a bad top-k entry as
 * 1 + token * EPX_MAX_TOPK + slot. */
#define EPX_MAX_TOPK 64

#endif /* EPX_CORE_LIMITS_H */
