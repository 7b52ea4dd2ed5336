/*
 * bf16 <-> fp32 conversions the C kernels share (fused_cpu.c, lora_cpu.c): bf16 is the top half of an fp32.
 */
#ifndef HF_PAGED_BF16_COMMON_H
#define HF_PAGED_BF16_COMMON_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* round to nearest even; NaN stays NaN (quiet). Branch-free so the loops that call it vectorize. */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t u = v.u, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}
#endif
