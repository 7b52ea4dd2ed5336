/* A list of recorded C kernel calls run by one call from Python (hf_paged/kernels/cpu/call_list.py).

The native decode program (hf_paged/executor/native_program.py) replays ~300 kernel calls a step; through ctypes
each costs 2-4 us of argument passing on our hosts, ~1 ms of a 10-15 ms batch-1 step. Here a run of consecutive
calls is an array of hfp_call, each the kernel's address, its signature and its arguments, and hfp_run_calls calls
them in order. An argument is a value, or (its bit in `cells`) the address of a cell read at each run: the row
count and the step's pointers, which Python sets before a replay as it sets the ctypes cells the direct calls read.

A signature is a string: the return type ('i' int, 'v' void), then one letter per argument: 'p' a pointer,
'l' an int64_t, 'i' an int, 'f' a float (a value only; stored as a double, converted to float here as ctypes
converts a Python float). Python reads the table (hfp_call_signature) and matches each kernel's ctypes
argtypes against it; a kernel of another signature stays a direct ctypes call. Each case below calls through
a function type of exactly that signature, pointers as void*: the calls ctypes would make. */
#include <stdint.h>

#define HFP_MAX_ARGS 28

typedef union { int64_t i; double f; } hfp_arg;

typedef struct {
    const void* fn;
    int32_t sig;      /* index into SIGNATURES */
    uint32_t cells;   /* bit j: a[j].i is the address of the argument's cell */
    hfp_arg a[HFP_MAX_ARGS];
} hfp_call;

static const char* const SIGNATURES[] = {
    "iplpppliiii",                 /* 0 the native GEMM (fp32, bf16) */
    "iplpipppliiii",               /* 1 the quantized linear */
    "vplplplppliifiii",            /* 2 RMSNorm with the residual add */
    "vpliplippliiii",              /* 3 rotary embedding */
    "vplpliii",                    /* 4 bf16 SiLU-mul */
    "ippllppplll",                 /* 5 the KV store */
    "ippllpppliiil",               /* 6 the int8 KV store */
    "ipllppplpppiplliiiififiiii",  /* 7 paged attention */
    "ippi",                        /* 8 the LoRA delta of a recorded call */
};
#define NUM_SIGNATURES ((int)(sizeof(SIGNATURES) / sizeof(SIGNATURES[0])))

const char* hfp_call_signature(int k) { return k >= 0 && k < NUM_SIGNATURES ? SIGNATURES[k] : 0; }
int hfp_call_max_args(void) { return HFP_MAX_ARGS; }
int hfp_call_size(void) { return (int)sizeof(hfp_call); }

typedef void* P;
typedef int64_t L;
#define A_P(j) ((P)(intptr_t)v[j])
#define A_L(j) ((L)v[j])
#define A_I(j) ((int)v[j])
#define A_F(j) ((float)c->a[j].f)

int hfp_run_calls(const hfp_call* calls, int n, int* failed_at) {
    for (int k = 0; k < n; ++k) {
        const hfp_call* c = &calls[k];
        if (c->sig < 0 || c->sig >= NUM_SIGNATURES) {
            *failed_at = k;
            return -1000;
        }
        const char* sig = SIGNATURES[c->sig];
        int64_t v[HFP_MAX_ARGS];
        for (int j = 0; sig[j + 1]; ++j) {
            if (!((c->cells >> j) & 1u)) v[j] = c->a[j].i;
            else if (sig[j + 1] == 'i') v[j] = *(const int*)(intptr_t)c->a[j].i;
            else v[j] = *(const int64_t*)(intptr_t)c->a[j].i;
        }
        int rc = 0;
        switch (c->sig) {
        case 0:
            rc = ((int (*)(P, L, P, P, P, L, int, int, int, int))c->fn)(
                A_P(0), A_L(1), A_P(2), A_P(3), A_P(4), A_L(5), A_I(6), A_I(7), A_I(8), A_I(9));
            break;
        case 1:
            rc = ((int (*)(P, L, P, int, P, P, P, L, int, int, int, int))c->fn)(
                A_P(0), A_L(1), A_P(2), A_I(3), A_P(4), A_P(5), A_P(6), A_L(7), A_I(8), A_I(9), A_I(10), A_I(11));
            break;
        case 2:
            ((void (*)(P, L, P, L, P, L, P, P, L, int, int, float, int, int, int))c->fn)(
                A_P(0), A_L(1), A_P(2), A_L(3), A_P(4), A_L(5), A_P(6), A_P(7), A_L(8), A_I(9), A_I(10), A_F(11),
                A_I(12), A_I(13), A_I(14));
            break;
        case 3:
            ((void (*)(P, L, int, P, L, int, P, P, L, int, int, int, int))c->fn)(
                A_P(0), A_L(1), A_I(2), A_P(3), A_L(4), A_I(5), A_P(6), A_P(7), A_L(8), A_I(9), A_I(10), A_I(11),
                A_I(12));
            break;
        case 4:
            ((void (*)(P, L, P, L, int, int, int))c->fn)(A_P(0), A_L(1), A_P(2), A_L(3), A_I(4), A_I(5), A_I(6));
            break;
        case 5:
            rc = ((int (*)(P, P, L, L, P, P, P, L, L, L))c->fn)(
                A_P(0), A_P(1), A_L(2), A_L(3), A_P(4), A_P(5), A_P(6), A_L(7), A_L(8), A_L(9));
            break;
        case 6:
            rc = ((int (*)(P, P, L, L, P, P, P, L, int, int, int, L))c->fn)(
                A_P(0), A_P(1), A_L(2), A_L(3), A_P(4), A_P(5), A_P(6), A_L(7), A_I(8), A_I(9), A_I(10), A_L(11));
            break;
        case 7:
            rc = ((int (*)(P, L, L, P, P, P, L, P, P, P, int, P, L, L, int, int, int, int, float, int, float, int,
                           int, int, int))c->fn)(
                A_P(0), A_L(1), A_L(2), A_P(3), A_P(4), A_P(5), A_L(6), A_P(7), A_P(8), A_P(9), A_I(10), A_P(11),
                A_L(12), A_L(13), A_I(14), A_I(15), A_I(16), A_I(17), A_F(18), A_I(19), A_F(20), A_I(21), A_I(22),
                A_I(23), A_I(24));
            break;
        case 8:
            rc = ((int (*)(P, P, int))c->fn)(A_P(0), A_P(1), A_I(2));
            break;
        default: /* a signature without its case: never skipped silently */
            rc = -1000;
        }
        if (rc) {
            *failed_at = k;
            return rc;
        }
    }
    return 0;
}
