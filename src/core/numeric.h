/*
 * The library's number formats, one definition for host C and device code: bf16 and fp8 e4m3
 * ("fn": max 448, no inf) conversions with round-to-nearest-even, and the scales of fp8 groups.
 * The CPU backend and the kernels call the same functions, so both produce the same bits by
 * construction.
 */
#ifndef EPX_CORE_NUMERIC_H
#define EPX_CORE_NUMERIC_H

#include <stdint.h>

#if defined(__CUDACC__)
#define EPX_HD __host__ __device__ __forceinline__
#else
#include <math.h>
#include <string.h>
#define EPX_HD static inline
#endif

/* Bit casts that compile to moves on both sides. */
EPX_HD uint32_t epx_f32_bits(float f)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
#endif
}

EPX_HD float epx_bits_f32(uint32_t u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
#endif
}

/* bf16 bits (low 16 bits of `v`) -> fp32: exact. */
EPX_HD float epx_bf16_to_f32(uint32_t v)
{
    return epx_bits_f32((v & 0xffffu) << 16);
}

/* fp32 -> bf16 bits, round to nearest even; a NaN stays a quiet NaN. */
EPX_HD uint16_t epx_f32_to_bf16(float f)
{
    const uint32_t u = epx_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One step of the final sum across nodes (docs/reference.md, Sums): node n's fp32 partial joins
 * the token's accumulator as is on the token's own node, else rounded to bf16 first, as it crosses
 * the network. A node with no contribution to the token is skipped by the caller. */
EPX_HD float epx_add_node_partial(float acc, float partial, int remote)
{
    const float p = remote ? epx_bf16_to_f32(epx_f32_to_bf16(partial)) : partial;
#if defined(__CUDA_ARCH__)
    return __fadd_rn(acc, p);
#else
    return acc + p;
#endif
}

/* Two fp32 values as one word of packed bf16 (lo in the low half), for vector stores. */
EPX_HD uint32_t epx_f32x2_to_bf16x2(float lo, float hi)
{
    return (uint32_t)epx_f32_to_bf16(lo) | ((uint32_t)epx_f32_to_bf16(hi) << 16);
}

/* fp32 -> fp8 e4m3 "fn": saturating at +-448 (inf too), NaN -> 0x7f, round to nearest even. */
EPX_HD uint8_t epx_f32_to_fp8_e4m3(float f)
{
    const uint32_t u = epx_f32_bits(f);
    const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7f;
    if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7eu);
    if (a < 0x3c800000u) {
        /* Below 2^-6: subnormals with quantum 2^-9. The scaling is exact and the conversion
         * rounds to nearest even; 8 (= 2^-6) is the encoding of the smallest normal. */
#if defined(__CUDA_ARCH__)
        return (uint8_t)(sign | (uint32_t)__float2int_rn(__fmul_rn(epx_bits_f32(a), 512.0f)));
#else
        return (uint8_t)(sign | (uint32_t)rintf(epx_bits_f32(a) * 512.0f));
#endif
    }
    /* Normal: round the 23-bit mantissa to 3 bits (nearest even; a carry bumps the exponent),
     * then rebias the exponent from 127 to 7. */
    const uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    const uint32_t code = rounded - (120u << 3);
    return (uint8_t)(sign | (code > 0x7eu ? 0x7eu : code));
}

/* The smallest power of two >= v, for a positive normal v (exact: bit arithmetic). */
EPX_HD float epx_f32_pow2_ceil(float v)
{
    const uint32_t u = epx_f32_bits(v);
    return (u & 0x7fffffu) ? epx_bits_f32((u & 0x7f800000u) + 0x800000u) : v;
}

/* The inverse scale of an fp8 e4m3 group whose largest magnitude is `amax` (not NaN): amax / 448
 * with amax floored at 1e-4, rounded up to a power of two when `pow2` (then exact in ue8m0). */
EPX_HD float epx_fp8_scale_inv(float amax, int pow2)
{
    const float a = amax < 1e-4f ? 1e-4f : amax;
#if defined(__CUDA_ARCH__)
    const float scale_inv = __fdiv_rn(a, 448.0f);
#else
    const float scale_inv = a / 448.0f;
#endif
    return pow2 ? epx_f32_pow2_ceil(scale_inv) : scale_inv;
}

/* The ue8m0 byte of a power-of-two scale: its biased exponent. */
EPX_HD uint32_t epx_ue8m0_of(float pow2_scale)
{
    return (epx_f32_bits(pow2_scale) >> 23) & 0xffu;
}

/* fp8 e4m3 "fn" -> fp32: exact; 0x7f and 0xff are NaN. */
EPX_HD float epx_fp8_e4m3_to_f32(uint8_t v)
{
    const uint32_t sign = (uint32_t)(v & 0x80u) << 24, exp = (v >> 3) & 0xfu, man = v & 0x7u;
    if (exp == 0xfu && man == 0x7u) return epx_bits_f32(sign | 0x7fc00000u);
    if (exp == 0) return epx_bits_f32(sign | epx_f32_bits((float)man * (1.0f / 512.0f)));
    return epx_bits_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

#endif /* EPX_CORE_NUMERIC_H */
