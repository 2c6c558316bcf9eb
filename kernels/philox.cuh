// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) as the
// kernels draw it: the counter (lo, hi, 0, 0) of one element, keyed by the 64-bit seed. The
// twin is cupytp/launchers/philox.py, so kernels draw the NumPy path's numbers bit for bit.
//
// Counters: element i (row-major index in the global tensor) of a draw gets the counter
// base + add + i, `base` read from device memory (rewritten before each CUDA-graph replay);
// a rank's block of the tensor maps its local index to i through `PhiloxBlock` (below).
// A uniform is the 53-bit integer of the first two words, (w0 >> 5) 2^26 + (w1 >> 6), over 2^53.
// Dropout draws eight elements per call: the element whose counter would be P reads 16-bit half
// P mod 8 of the draw at P - P mod 8 (half k: the low (k even) or high 16 bits of word k / 2),
// and is kept iff that half >= ceil(p 2^16) (half / 2^16 >= p, exactly: p counts in steps of
// 2^-16). Draws start at a multiple of 8 (cupytp.tensor.random), so one call serves eight
// global neighbours.
#pragma once

struct PhiloxWords {
    unsigned w0, w1, w2, w3;
};

__device__ __forceinline__ PhiloxWords philox4x32_10(unsigned long long counter,
                                                     unsigned long long seed)
{
    unsigned c0 = static_cast<unsigned>(counter), c1 = static_cast<unsigned>(counter >> 32);
    unsigned c2 = 0, c3 = 0;
    unsigned k0 = static_cast<unsigned>(seed), k1 = static_cast<unsigned>(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return {c0, c1, c2, c3};
}

// the 53-bit integer of two words (a uniform in [0, 1) times 2^53)
__device__ __forceinline__ unsigned long long philox_bits53(unsigned a, unsigned b)
{
    return (static_cast<unsigned long long>(a >> 5) << 26) | (b >> 6);
}

// a float64 uniform in [0, 1) from two words
__device__ __forceinline__ double philox_uniform(unsigned a, unsigned b)
{
    return static_cast<double>(philox_bits53(a, b)) * (1.0 / 9007199254740992.0);
}

// word k (0..3) of a draw
__device__ __forceinline__ unsigned philox_word(const PhiloxWords& w, unsigned k)
{
    return k == 0 ? w.w0 : k == 1 ? w.w1 : k == 2 ? w.w2 : w.w3;
}

// half k (0..7) of a draw: the low or high 16 bits of word k / 2
__device__ __forceinline__ unsigned philox_half(const PhiloxWords& w, unsigned k)
{
    return philox_word(w, k / 2) >> 16 * (k % 2) & 0xFFFFu;
}

// dropout's keep bits of the eight elements at counters `group` .. group + 7 (group a multiple
// of 8): bit k kept iff half k >= threshold = ceil(p 2^16)
__device__ __forceinline__ unsigned dropout_byte(unsigned long long group,
                                                 unsigned long long seed,
                                                 unsigned long long threshold)
{
    const PhiloxWords w = philox4x32_10(group, seed);
    const unsigned t = static_cast<unsigned>(threshold);
    const unsigned words[4] = {w.w0, w.w1, w.w2, w.w3};
    unsigned bits = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k)
        bits |= static_cast<unsigned>((words[k] & 0xFFFFu) >= t) << 2 * k |
                static_cast<unsigned>((words[k] >> 16) >= t) << (2 * k + 1);
    return bits;
}

// whether dropout keeps the element at counter P (one call; dropout_byte serves eight)
__device__ __forceinline__ bool dropout_keeps(unsigned long long counter, unsigned long long seed,
                                              unsigned long long threshold)
{
    const PhiloxWords w = philox4x32_10(counter & ~7ull, seed);
    return philox_half(w, static_cast<unsigned>(counter & 7)) >= threshold;
}

// A rank's block of a global tensor, its dimensions merged where they are contiguous in both:
// up to four dimensions of local extents (e0), e1, e2, e3 (innermost) and global strides
// s0, s1, s2, s3; `dims` of them are used (the innermost ones). Local row-major index l of the
// block is global index first + sum_d i_d s_d, `first` (the block's offset) folded into `add`.
struct PhiloxBlock {
    int dims;
    long long e1, e2, e3, s0, s1, s2, s3;

    __device__ __forceinline__ unsigned long long global(unsigned long long l) const
    {
        if (dims == 1)
            return l * s3;
        unsigned long long g = (l % e3) * s3;
        l /= e3;
        if (dims == 2)
            return g + l * s2;
        g += (l % e2) * s2;
        l /= e2;
        if (dims == 3)
            return g + l * s1;
        g += (l % e1) * s1;
        return g + (l / e1) * s0;
    }

    // true when the `n` local elements from a multiple of n are global neighbours s3 apart
    __device__ __forceinline__ bool runs_of(int n) const { return dims == 1 || e3 % n == 0; }
};

// The kernel parameters of a draw over a block (see the launchers' `Counters.arguments`).
#define PHILOX_BLOCK_PARAMS                                                                      \
    unsigned long long seed, const unsigned long long *base, unsigned long long add, int dims,   \
        long long e1, long long e2, long long e3, long long s0, long long s1, long long s2,      \
        long long s3
#define PHILOX_BLOCK PhiloxBlock{dims, e1, e2, e3, s0, s1, s2, s3}
