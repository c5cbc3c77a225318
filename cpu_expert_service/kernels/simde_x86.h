/* Test-only: the AVX-512 intrinsics the kernels use, in portable SIMDe form (plus the few
 * SIMDe 0.7.4 lacks), so moe_avx512.c / moe_amx.c run on a CPU without AVX-512. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <string.h>
static inline simde__m512i moe_simde_cvtepu16_epi32(simde__m256i a) {
    uint16_t s[16]; uint32_t d[16]; simde__m512i r;
    memcpy(s, &a, 32);
    for (int i = 0; i < 16; i++) d[i] = s[i];
    memcpy(&r, d, 64);
    return r;
}
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 moe_simde_cvtepu16_epi32
static inline simde__m512i moe_simde_cvtepu8_epi32(simde__m128i a) { /* absent from SIMDe */
    uint8_t s[16]; uint32_t d[16]; simde__m512i r;
    memcpy(s, &a, 16);
    for (int i = 0; i < 16; i++) d[i] = s[i];
    memcpy(&r, d, 64);
    return r;
}
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 moe_simde_cvtepu8_epi32
static inline uint16_t moe_simde_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline simde__m256i moe_simde_cvtneps_pbh(simde__m512 a) {
    float s[16]; uint16_t d[16]; simde__m256i r;
    memcpy(s, &a, 64);
    for (int i = 0; i < 16; i++) d[i] = moe_simde_bf16(s[i]);
    memcpy(&r, d, 32);
    return r;
}
static inline simde__m512bh moe_simde_cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
    float s[32]; uint16_t d[32]; simde__m512bh r;
    memcpy(s, &b, 64); memcpy(s + 16, &a, 64);
    for (int i = 0; i < 32; i++) d[i] = moe_simde_bf16(s[i]);
    memcpy(&r, d, 64);
    return r;
}
static inline float moe_simde_reduce_add_ps(simde__m512 a) {
    float s[16], t = 0.f; memcpy(s, &a, 64);
    for (int i = 0; i < 16; i++) t += s[i];
    return t;
}
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh moe_simde_cvtneps_pbh
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh moe_simde_cvtne2ps_pbh
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps moe_simde_reduce_add_ps
static inline simde__m512 moe_simde_cvtepi32_ps(simde__m512i a) {
    int32_t s[16]; float d[16]; simde__m512 r;
    memcpy(s, &a, 64);
    for (int i = 0; i < 16; i++) d[i] = (float)s[i];
    memcpy(&r, d, 64);
    return r;
}
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps moe_simde_cvtepi32_ps
