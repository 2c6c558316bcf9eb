// Flash attention (FlashAttention-2): softmax(scale q kᵀ) v over (B, H, T, D) queries and
// (B, H, S, D) keys and values, bf16 or fp16 in and out, fp32 accumulation on the tensor cores
// (mma.sync m16n8k16 fed by ldmatrix; with -DFLASH_HOPPER=1, compiled for sm_90a, Hopper's
// warpgroup products wgmma from swizzled shared tiles, below). The (T, S) scores are never stored:
// each block keeps a tile of them in registers.
//
// Blocks run in the order of their index, x first: the grids are (B·H, query tiles) and (B·Hk, key
// blocks), so the longest causal blocks of every head run first (a list schedule's best order).
// forward:  one block per 64 queries of one (b, h); key/value tiles of 64 stream through shared
//           memory (cp.async, the next tile loading while this one is used); online softmax in
//           registers; writes o and the log-sum-exp lse (fp32, (B, H, T)) for the backward.
// backward: `flash_backward_delta` computes delta = rowsum(do ∘ o) and zeroes dq's fp32 sums
//           (16-byte loads, D / 8 lanes a row); then one block of 8 warps per 128 keys of one
//           (b, h) (16 keys a warp) walks the query tiles of 64 (the next tile's q and do loading
//           into second buffers, its lse and delta into registers, while this one is used),
//           recomputes P from lse, keeps dk and dv in registers and adds its share of dq into the
//           fp32 sums with atomics (each warp 16 queries x half of D, one addition per element
//           per 128 keys: on sm_90 four adjacent floats a vector reduction, else one atomic
//           each); `flash_backward_dq` scales and converts the sums, eight elements a thread.
// Causal: query t sees keys s <= t + S - T; a query that sees no key gives zeros (lse = -inf).
// Grouped-query attention: k and v have their own head count; query head h reads key/value head
// (h + kv_offset) / kv_group (kv_group query heads share one, with no copy of k or v), and the
// backward's blocks, one per 128 keys of one (b, key/value head), sum dk and dv over the query
// heads of their group (a key/value head no query head reads gets zeros).
// Dropout on the probabilities: element (b, h, t, s) of the global (B, H_global, T, S) tensor is
// kept by philox.cuh's dropout rule at counter base + add + ((b·H_global + h)·T + t)·S + s (half
// P mod 8 of the draw at P - P mod 8 against `threshold` = ceil(p·2¹⁶): cupytp.tensor.random's
// draw, eight keys to a Philox call); kept values are scaled by 1/(1-p). The `_dropout_at` kernels
// take a block of a longer sequence: t and s are then its rows' and keys' global positions
// (`rows`, `cols`) in a problem of t_global queries and s_global keys. The plain `_dropout`
// kernels may keep the bits: given a `mask` of (B·H, T, mask_pitch) bytes, the forward writes each
// visited octet of keys and the backward reads it instead of drawing it again.
// Inputs are strided views (D contiguous, rows 16-byte aligned); strides are in elements.
#include "common.cuh"
#include "philox.cuh"

namespace flash {

constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int BLOCK_M = 64;  // queries per tile: 16 per warp in the forward
constexpr int BLOCK_N = 64;  // keys per tile of the forward
// the backward: 16 keys per warp, so that a query tile's dq sums (fp32 atomics) serve 128 keys
constexpr int BACKWARD_WARPS = 8;
constexpr int BACKWARD_THREADS = 32 * BACKWARD_WARPS;
constexpr int BACKWARD_BLOCK_N = 16 * BACKWARD_WARPS;
constexpr int PAD = 8;       // elements after each shared-memory row: ldmatrix rows hit other banks
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
// blocks per multiprocessor the register budget is cut to (65536 registers / 128 threads), the
// most that ptxas fits without spilling: dropout's Philox rounds and (DROPOUT 2) position maps
// take registers at head dim 128 and with the maps (fewer on Hopper, whose products keep no
// operand fragments in registers)
#if FLASH_HOPPER
#define FLASH_FORWARD_BLOCKS(D, DROPOUT) ((D) == 64 ? 4 : 3)
#else
#define FLASH_FORWARD_BLOCKS(D, DROPOUT) ((D) == 64 ? ((DROPOUT) ? 3 : 4) : (DROPOUT) ? 2 : 3)
#endif
#define FLASH_BACKWARD_BLOCKS(D) 1

struct Strides {
    long long batch, head, row;
};

// ---- PTX wrappers -----------------------------------------------------------------------------
__device__ __forceinline__ unsigned shared_address(const void* p)
{
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zeros when !valid, and then nothing is read (the
// source size is 0), so `global` may point past the tensor
__device__ __forceinline__ void cp_async16(void* smem, const void* global, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem)),
                 "l"(global), "r"(valid ? 16 : 0));
}

#if __CUDA_ARCH__ >= 900
// four adjacent floats (16-byte aligned) added into global memory at once, unordered
__device__ __forceinline__ void red_add4(float* address, float a, float b, float c, float d)
{
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(address),
                 "f"(a), "f"(b), "f"(c), "f"(d)
                 : "memory");
}
#endif

__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, register i holds it.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(smem)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(smem)));
}

// d += a (16x16, row) · b (16x8, col), fp32 accumulators
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                    unsigned b1);

template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4],
                                                   unsigned b0, unsigned b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                            unsigned b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// two floats as one register of two 16-bit values, `lo` in the low half
template <typename T>
__device__ __forceinline__ unsigned pack(float lo, float hi);

template <>
__device__ __forceinline__ unsigned pack<__nv_bfloat16>(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

template <>
__device__ __forceinline__ unsigned pack<__half>(float lo, float hi)
{
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// ---- fragments --------------------------------------------------------------------------------
// The element offset of this lane's row address for ldmatrix_x4 of the 16x16 tile at (row0, col0)
// of a shared tile with `stride` elements per row.
// A operand stored row-major (rows = m): registers a0..a3 of mma.
__device__ __forceinline__ int a_rows(int row0, int col0, int stride, int lane)
{
    return (row0 + lane % 16) * stride + col0 + lane / 16 * 8;
}

// B operand stored n-major (rows = n, ldmatrix_x4): b0, b1 of n-octet row0, then of row0 + 8.
// Read with ldmatrix_x4_trans from k-major storage, the same addresses give an A operand.
__device__ __forceinline__ int b_rows(int row0, int col0, int stride, int lane)
{
    return (row0 + lane / 16 * 8 + lane % 8) * stride + col0 + (lane / 8) % 2 * 8;
}

// B operand stored k-major (rows = k, ldmatrix_x4_trans): b0, b1 of n-octet col0, then col0 + 8.
__device__ __forceinline__ int bt_rows(int row0, int col0, int stride, int lane)
{
    return (row0 + (lane / 8) % 2 * 8 + lane % 8) * stride + col0 + lane / 16 * 8;
}

// The A fragment (16 rows x 16 columns) held by the accumulators of two adjacent column octets.
template <typename T>
__device__ __forceinline__ void accumulators_as_a(unsigned (&a)[4], const float (&lo)[4],
                                                  const float (&hi)[4])
{
    a[0] = pack<T>(lo[0], lo[1]);
    a[1] = pack<T>(lo[2], lo[3]);
    a[2] = pack<T>(hi[0], hi[1]);
    a[3] = pack<T>(hi[2], hi[3]);
}

template <int N>
__device__ __forceinline__ void zero(float (&x)[N][4])
{
#pragma unroll
    for (int i = 0; i < N; ++i)
        x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.f;
}

// ---- Hopper (FLASH_HOPPER, sm_90a): warpgroup products from shared memory --------------------
// Four warps are one warpgroup (the forward's block; the backward's two halves of 64 keys):
// wgmma m64nNk16 gives warp w the accumulators of rows 16 (w mod 4) .. + 15 in mma.sync's m16n8
// layout, so the softmax, the dropout draws and the A fragments made from accumulators are the
// mma.sync path's. The products read their shared operands through descriptors: tiles of ROWS
// rows x 64 elements (128 bytes a row, one tile per 64 of D) in the 128-byte swizzle (the 16-byte
// chunk c of row r lies at chunk c ^ (r mod 8), tiles 1024-byte aligned), K-major (q kᵀ, k qᵀ,
// v doᵀ: a step of 16 along D is 32 bytes along the rows) or M-/N-major (p v, pᵀ do, dsᵀ q,
// ds k: a step of 16 keys or queries is 16 rows). Each product is waited for before its
// accumulators are read.
#if FLASH_HOPPER
constexpr int SWIZZLE_TILE = 64 * 64;  // elements of one 64-row tile

// the 64-bit shared-memory matrix descriptor, 128-byte swizzle; offsets in bytes. A tile's
// descriptor `offset` bytes on is its descriptor + offset / 16: shared addresses stay below the
// address field's 256 KB, so the sum never carries out of it (one add per product; the tile's
// descriptor is made once). A step of 16 rows of 128 bytes is + 128.
__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned leading,
                                                         unsigned stride)
{
    return static_cast<unsigned long long>((address & 0x3FFFF) >> 4) |
           static_cast<unsigned long long>(leading >> 4) << 16 |
           static_cast<unsigned long long>(stride >> 4) << 32 | 1ull << 62;
}

__device__ __forceinline__ void warpgroup_fence()
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void warpgroup_commit_and_wait()
{
    asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" :::
                     "memory");
}

// what cp.async wrote to shared memory, made visible to the warpgroup products
__device__ __forceinline__ void fence_async_shared()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// one register kept where it is: no instruction is moved across this point to read or write it
__device__ __forceinline__ void pin_register(unsigned& r)
{
    asm volatile("" : "+r"(r)::"memory");
}

__device__ __forceinline__ void pin_register(float& r)
{
    asm volatile("" : "+f"(r)::"memory");
}

// Fragments pinned: the accumulators (float) kept in place around the asynchronous products, and
// A fragments (unsigned) made by ordinary instructions all finished before the fence that
// precedes their products (made one product at a time, each product would need a fence of its own)
template <typename E, int N>
__device__ __forceinline__ void pin(E (&x)[N][4])
{
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            pin_register(x[i][c]);
}

// d (64 x N) = a (64 x 16) · b (16 x N), both in shared memory (descriptors), plus d when
// `accumulate`: K-major both (TRANSPOSED 0: a row-major, b given as its N x 16 transpose) or
// M-/N-major both (1)
template <typename T, int N, int TRANSPOSED>
__device__ __forceinline__ void product_ss(float (&d)[N / 8][4], unsigned long long a,
                                           unsigned long long b, int accumulate);

// d (64 x N) += a (64 x 16, registers: the A fragment of mma.sync per warp) · b (16 x N, N-major
// in shared memory)
template <typename T, int N>
__device__ __forceinline__ void product_rs(float (&d)[N / 8][4], const unsigned (&a)[4],
                                           unsigned long long b);

// the N / 2 accumulators a thread of m64nN, as asm operands and as their text (each N's list
// the smaller N's and the rest)
#define FLASH_ACCUMULATORS_32                                   \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
    "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
    "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
#define FLASH_REGISTERS_32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define FLASH_ACCUMULATORS_64                                   \
    FLASH_ACCUMULATORS_32,                                      \
    "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
    "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
    "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define FLASH_REGISTERS_64  \
    FLASH_REGISTERS_32 ", " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FLASH_ACCUMULATORS_128                                      \
    FLASH_ACCUMULATORS_64,                                          \
    "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),     \
    "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),     \
    "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), \
    "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
    "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
    "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
    "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
    "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define FLASH_REGISTERS_128                                                            \
    FLASH_REGISTERS_64 ", "                                                            \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// d (64 x N) = a · b from shared memory, plus d when `accumulate` (the operands a, b and the
// predicate's flag follow the N / 2 accumulators)
#define FLASH_PRODUCT_SS(T, TYPE, N, TRANSPOSED, A, B, FLAG)                                      \
    template <>                                                                                    \
    __device__ __forceinline__ void product_ss<T, N, TRANSPOSED>(                                  \
        float(&d)[N / 8][4], unsigned long long a, unsigned long long b, int accumulate)           \
    {                                                                                              \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" FLAG ", 0;\n"                            \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " "           \
                     "{" FLASH_REGISTERS_##N "}, %" A ", %" B ", p, 1, 1, " #TRANSPOSED ", "     \
                     #TRANSPOSED ";\n}\n"                                                          \
                     : FLASH_ACCUMULATORS_##N                                                      \
                     : "l"(a), "l"(b), "r"(accumulate));                                          \
    }

// d (64 x N) += a (registers) · b (N-major, shared memory)
#define FLASH_PRODUCT_RS(T, TYPE, N, A, B)                                                         \
    template <>                                                                                    \
    __device__ __forceinline__ void product_rs<T, N>(float(&d)[N / 8][4], const unsigned(&a)[4],   \
                                                     unsigned long long b)                         \
    {                                                                                              \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " "           \
                     "{" FLASH_REGISTERS_##N "}, " A ", %" B ", 1, 1, 1, 1;\n"                   \
                     : FLASH_ACCUMULATORS_##N                                                      \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                       \
    }

#define FLASH_PRODUCTS(T, TYPE)                                                                    \
    FLASH_PRODUCT_SS(T, TYPE, 64, 0, "32", "33", "34")                                             \
    FLASH_PRODUCT_SS(T, TYPE, 64, 1, "32", "33", "34")                                             \
    FLASH_PRODUCT_SS(T, TYPE, 32, 1, "16", "17", "18")                                             \
    FLASH_PRODUCT_RS(T, TYPE, 64, "{%32, %33, %34, %35}", "36")                                   \
    FLASH_PRODUCT_RS(T, TYPE, 128, "{%64, %65, %66, %67}", "68")

FLASH_PRODUCTS(__nv_bfloat16, "bf16")
FLASH_PRODUCTS(__half, "f16")

// ROWS x D elements from `src` (rows `row_stride` apart, `rows` of them valid; zeros past them)
// into swizzled tiles of 64 columns, ROWS rows each
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void load_swizzled(T* smem, const T* src, long long row_stride, int rows)
{
    constexpr int CHUNKS = D / 8, STEP = NT / CHUNKS;  // a thread's rows are STEP apart
    static_assert(NT % CHUNKS == 0 && ROWS % STEP == 0, "whole rows a pass");
    const int chunk = threadIdx.x % CHUNKS, r0 = threadIdx.x / CHUNKS;
    const T* from = src + r0 * row_stride + chunk * 8;
#pragma unroll
    for (int i = 0; i < ROWS / STEP; ++i) {
        const int r = r0 + i * STEP;
        const bool valid = r < rows;
        cp_async16(smem + chunk / 8 * ROWS * 64 + r * 64 + ((chunk % 8) ^ (r % 8)) * 8,
                   from + i * STEP * row_stride, valid);
    }
}
#endif

// ---- dropout ----------------------------------------------------------------------------------
// MAPS: the kernels of a block of a longer sequence (`_dropout_at`), reading its query and key
// positions; without, a row's and a key's position is its index (no loads, no checks).
template <bool MAPS>
struct Dropout {
    unsigned long long threshold;  // keep iff the half drawn >= threshold = ceil(p 2^16)
    float scale;                   // 1 / (1 - p)
    unsigned long long seed;
    const unsigned long long* base;  // device counter base (rewritten before CUDA-graph replays)
    unsigned long long add;
    int heads;        // H_global
    int head_offset;  // global index of this tensor's head 0
    int batch_offset;
    const long long* rows;  // global query position of each row (null: the row's index)
    const long long* cols;  // global key position of each key (null: the key's index)
    long long t_global;     // the global problem's query and key counts
    long long s_global;
    unsigned char* mask;    // kept bits (B·H, T, mask_pitch) bytes (below), or null
    long long mask_pitch;

    // the global position of row t < t_len (of key s < s_len)
    __device__ __forceinline__ long long row(int t) const { return MAPS && rows ? rows[t] : t; }
    __device__ __forceinline__ long long col(int s) const { return MAPS && cols ? cols[s] : s; }

    // the counter of (row 0, key 0) of head (b, h): base + add + (b H + h) T S
    __device__ __forceinline__ unsigned long long head_counter(int b, int h) const
    {
        const unsigned long long bh =
            static_cast<unsigned long long>(b + batch_offset) * heads + h + head_offset;
        return *base + add + bh * t_global * s_global;
    }

    // the counter of (row t, key 0): rows past t_len (masked) read row t_len - 1's
    __device__ __forceinline__ unsigned long long row_counter(unsigned long long head, int t,
                                                              int t_len) const
    {
        return head + static_cast<unsigned long long>(row(MAPS ? min(t, t_len - 1) : t)) * s_global;
    }

    // whether base + add and S let eight global neighbours share a Philox call at all
    __device__ __forceinline__ bool groups_possible() const
    {
        return (*base + add) % 8 == 0 && s_global % 8 == 0;
    }

    // whether keys l .. l + 7 (l a multiple of 8; those from s_len on are masked and not looked
    // at) are global neighbours from a multiple of 8
    __device__ __forceinline__ bool group_at(int l, int s_len) const
    {
        if (!MAPS || !cols)
            return true;
        const int last = min(l + 7, s_len - 1);
        return last < l || (cols[l] % 8 == 0 && cols[last] - cols[l] == last - l);
    }

    // Row t of head bh (blockIdx.x of the forward) in the kept-bits store: byte o holds the bits
    // of keys 8 o .. 8 o + 7 (bit j: key 8 o + j). The forward writes the octets of the key tiles
    // it visits where eight keys share a Philox call (plain dropout, `grouped`), and the backward
    // reads them instead of drawing again (bytes of keys a query does not see are never looked
    // at: their scores are masked).
    __device__ __forceinline__ unsigned char* mask_row(long long bh, int t, int t_len) const
    {
        return mask + (bh * t_len + t) * mask_pitch;
    }

    // the counter offset of key s: its global position (keys past s_len are masked)
    __device__ __forceinline__ unsigned long long key(int s, int s_len) const
    {
        return static_cast<unsigned long long>(col(MAPS ? min(s, s_len - 1) : s));
    }
};

// Which of a thread's accumulator scores of one tile dropout keeps, by philox.cuh's dropout rule
// over the scores' counters, as bits that forward_dropped and backward_dropped test at positions
// known when compiling (one bit test an element, no extraction). Where the tile's
// key octets are global neighbours from a multiple of 8 (always but where S, base + add or the
// block's key positions say otherwise), each octet of one query row is one Philox call: the
// lanes that hold an octet's keys draw it together (each lane a share of the tile's octets) and
// exchange the bits by shuffles, four calls per thread and tile instead of one per score. Every
// lane of the warp calls these together.
template <bool MAPS>
__device__ __forceinline__ bool together(const Dropout<MAPS>& dropout, bool grouped, int n_first,
                                         int octets, int s_len)
{
    if (!MAPS)
        return grouped;
    bool all = grouped;
    for (int o = 0; o < octets; ++o)
        all = all && dropout.group_at(n_first + 8 * o, s_len);
    return __all_sync(0xffffffffu, all);
}

// x where `word` has a bit of `mask`, else 0: PTX's and with setp, which ptxas makes one bit test
// (C's form compiles to a shift, a mask and a compare)
__device__ __forceinline__ float kept_or_zero(unsigned word, unsigned mask, float x)
{
    asm("{\n.reg .pred p;\n.reg .b32 t;\nand.b32 t, %1, %2;\nsetp.ne.b32 p, t, 0;\n"
        "selp.f32 %0, %0, 0f00000000, p;\n}\n"
        : "+f"(x)
        : "r"(word), "r"(mask));
    return x;
}

// the same for x, and y scaled by `scale` where kept
__device__ __forceinline__ void kept_or_zero(unsigned word, unsigned mask, float& x, float& y,
                                             float scale)
{
    asm("{\n.reg .pred p;\n.reg .b32 t;\nand.b32 t, %2, %3;\nsetp.ne.b32 p, t, 0;\n"
        "selp.f32 %0, %0, 0f00000000, p;\n"
        "mul.f32 %1, %1, %4;\nselp.f32 %1, %1, 0f00000000, p;\n}\n"
        : "+f"(x), "+f"(y)
        : "r"(word), "r"(mask), "f"(scale));
}

// Forward: accumulator c of octet nt is (row rows[c / 2], key n0 + 8 nt + 2 quad + c % 2): the
// quad's four lanes hold the 16 octets (r, nt) of the same two rows, lane quad drawing octets
// g = 4 quad .. 4 quad + 3 (g = 8 r + nt) into the bytes of one register, which it returns (the
// kept bits of keys n0 + 32 (quad % 2) .. + 31 of row rows[quad / 2]; 0 on the per-score path).
// kept[2 r + nt / 4] holds accumulator c's bit at 8 (nt % 4) + c % 2 (r = c / 2): lane q's
// register shifted by 2 quad. Kept probabilities are not scaled here: 1 / (1 - p) multiplies o
// at the end.
__device__ __forceinline__ float forward_dropped(const unsigned (&kept)[4], int nt, int c, float x)
{
    return kept_or_zero(kept[2 * (c / 2) + nt / 4], 1u << (8 * (nt % 4) + c % 2), x);
}

template <bool MAPS>
__device__ __forceinline__ unsigned forward_keeps(unsigned (&kept)[4],
                                              const Dropout<MAPS>& dropout, bool grouped,
                                              const unsigned long long (&rows)[2], int n0,
                                              int quad, int s_len)
{
    constexpr int OCTETS = BLOCK_N / 8;
    static_assert(OCTETS == 8, "a quad shares 16 octets: 8 per row");
    if (together(dropout, grouped, n0, OCTETS, s_len)) {
        const unsigned long long row = quad >= 2 ? rows[1] : rows[0];
        const int nt0 = 4 * (quad % 2);
        unsigned mine = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            mine |= dropout_byte(row + dropout.key(n0 + 8 * (nt0 + j), s_len), dropout.seed,
                                 dropout.threshold)
                    << 8 * j;
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int q = 0; q < 4; ++q)  // lane quad q's register
            kept[q] = __shfl_sync(0xffffffffu, mine, (lane & ~3) | q) >> 2 * quad;
        return mine;
    }
    // one call per score, rolled: unrolled, its 32 calls would set the kernel's register count
    unsigned bits = 0;
#pragma unroll 1
    for (int i = 0; i < 4 * OCTETS; ++i) {
        const int nt = i / 4, c = i % 4;
        bits |= static_cast<unsigned>(dropout_keeps(
                    (c < 2 ? rows[0] : rows[1]) + dropout.key(n0 + 8 * nt + 2 * quad + c % 2, s_len),
                    dropout.seed, dropout.threshold))
                << i;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // octets nt = 4 (q % 2) + j, accumulators 2 (q / 2) and + 1
        kept[q] = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            kept[q] |= (bits >> (4 * (4 * (q % 2) + j) + 2 * (q / 2)) & 3u) << 8 * j;
    }
    return 0;
}

// Backward (transposed): accumulator c of octet nt is (query queries(nt)[c % 2], key
// key0 + group + 8 (c / 2)), key0 = n0 + 16 warp the warp's first key: the eight lanes of one
// quad hold the 32 octets (nt, query, key octet) of the same queries, lane group drawing the four
// of nt = group (byte 2 (c / 2) + c % 2 = c) into one register, or reading them from the
// forward's store (`stored`: row 0 of this head in it, or null). `query(t)` gives query t's
// counter at key 0. kept[nt] holds accumulator c's bit at 8 c: lane 4 nt + quad's register
// shifted by group.
// The backward's accumulator c of octet nt: p dropped (1 / (1 - p) multiplies dv at the end), dp
// dropped or scaled.
__device__ __forceinline__ void backward_dropped(const unsigned (&kept)[8], int nt, int c,
                                                 float scale, float& p, float& dp)
{
    kept_or_zero(kept[nt], 1u << 8 * c, p, dp, scale);
}

template <bool MAPS, int OCTETS, typename Query>
__device__ __forceinline__ void backward_keeps(unsigned (&kept)[OCTETS],
                                               const Dropout<MAPS>& dropout, bool grouped,
                                               Query query, const unsigned char* stored, int m0,
                                               int key0, int group, int quad, int t_len,
                                               int s_len)
{
    static_assert(OCTETS == 8, "one octet of queries per group of lanes");
    if (together(dropout, grouped, key0, 2, s_len)) {
        const int t = m0 + 8 * group + 2 * quad;
        unsigned mine = 0;
        if (stored) {  // octets key0 / 8 and key0 / 8 + 1 of queries t and t + 1
            const auto octets = [&](int row) -> unsigned {
                return row < t_len ? *reinterpret_cast<const unsigned short*>(
                                         stored + row * dropout.mask_pitch + key0 / 8)
                                   : 0u;
            };
            mine = __byte_perm(octets(t), octets(t + 1), 0x5140);
        } else {
            const unsigned long long queries[2] = {query(t), query(t + 1)};
#pragma unroll
            for (int c = 0; c < 4; ++c)
                mine |= dropout_byte(queries[c % 2] + dropout.key(key0 + 8 * (c / 2), s_len),
                                     dropout.seed, dropout.threshold)
                        << 8 * c;
        }
#pragma unroll
        for (int nt = 0; nt < OCTETS; ++nt)
            kept[nt] = __shfl_sync(0xffffffffu, mine, 4 * nt + quad) >> group;
        return;
    }
    unsigned bits = 0;  // one call per score, rolled (as in forward_keeps)
#pragma unroll 1
    for (int i = 0; i < 4 * OCTETS; ++i) {
        const int nt = i / 4, c = i % 4;
        const int t = m0 + 8 * nt + 2 * quad + c % 2;
        bits |= static_cast<unsigned>(dropout_keeps(
                    query(t) + dropout.key(key0 + group + 8 * (c / 2), s_len), dropout.seed,
                    dropout.threshold))
                << i;
    }
#pragma unroll
    for (int nt = 0; nt < OCTETS; ++nt)  // bit c of the octet's four to bit 8 c
        kept[nt] = ((bits >> 4 * nt & 15u) * 0x204081u) & 0x01010101u;
}

// ---- tiles ------------------------------------------------------------------------------------
extern __shared__ __align__(16) unsigned char shared[];

// ROWS x D elements from `src` (rows `row_stride` apart, `rows` of them valid) into shared rows of
// D + PAD elements; rows past `rows` become zeros.
template <typename T, int D, int ROWS, int NT = THREADS>
__device__ __forceinline__ void load_tile(T* smem, const T* src, long long row_stride, int rows)
{
    constexpr int CHUNKS = D / 8, STEP = NT / CHUNKS;  // 16-byte pieces per row; rows a pass
    static_assert(NT % CHUNKS == 0 && ROWS % STEP == 0, "whole rows a pass");
    const int col = threadIdx.x % CHUNKS * 8, r0 = threadIdx.x / CHUNKS;
    const T* from = src + r0 * row_stride + col;
#pragma unroll
    for (int i = 0; i < ROWS / STEP; ++i) {
        const int r = r0 + i * STEP;
        const bool valid = r < rows;
        cp_async16(smem + r * (D + PAD) + col, from + i * STEP * row_stride, valid);
    }
}

// ---- forward ----------------------------------------------------------------------------------
// a tile of ROWS rows: swizzled for the warpgroup products on Hopper, padded rows otherwise
template <typename T, int D, int ROWS = BLOCK_N, int NT = THREADS>
__device__ __forceinline__ void tile(T* smem, const T* src, long long row_stride, int rows)
{
#if FLASH_HOPPER
    load_swizzled<T, D, ROWS, NT>(smem, src, row_stride, rows);
#else
    load_tile<T, D, ROWS, NT>(smem, src, row_stride, rows);
#endif
}

// the tiles that cp.async wrote, visible to every warp (and to the warpgroup products)
__device__ __forceinline__ void tiles_ready()
{
#if FLASH_HOPPER
    fence_async_shared();
#endif
    __syncthreads();
}

#if FLASH_HOPPER
// the block's shared memory from its first 1024-byte boundary on (the swizzle's repeat)
__device__ __forceinline__ unsigned char* swizzle_aligned_shared()
{
    return shared + (1024 - shared_address(shared) % 1024) % 1024;
}
#endif

template <typename T, int D, int DROPOUT>
__device__ void forward(const T* q, const T* k, const T* v, T* o, float* lse, int heads,
                        int kv_group, int kv_offset, int t_len, int s_len, Strides qs,
                        Strides ks, Strides vs, Strides os, float scale, bool causal,
                        const Dropout<DROPOUT == 2>& dropout)
{
    static_assert(BLOCK_M == BLOCK_N, "q, k and v tiles of one size");
#if FLASH_HOPPER
    constexpr int STRIDE = D;  // swizzled rows of D
    T* sq = reinterpret_cast<T*>(swizzle_aligned_shared());
#else
    constexpr int STRIDE = D + PAD;
    T* sq = reinterpret_cast<T*>(shared);
#endif
    T* sk = sq + BLOCK_M * STRIDE;
    T* sv = sk + BLOCK_N * STRIDE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, quad = lane % 4;  // fragment row, fragment column pair
    // a tile of queries of every head, the last (the longest, causal) first
    const int bh = blockIdx.x, m0 = (gridDim.y - 1 - blockIdx.y) * BLOCK_M;
    const int b = bh / heads, h = bh % heads;
    const int kv = (h + kv_offset) / kv_group;  // the key/value head of query head h
    q += b * qs.batch + h * qs.head + m0 * qs.row;
    k += b * ks.batch + kv * ks.head;
    v += b * vs.batch + kv * vs.head;
    o += b * os.batch + h * os.head;
    const int diagonal = s_len - t_len;
    const int last_row = min(m0 + BLOCK_M, t_len) - 1;
    const int n_end = causal ? min(s_len, last_row + diagonal + 1) : s_len;
    const int n_tiles = n_end > 0 ? (n_end + BLOCK_N - 1) / BLOCK_N : 0;
    const float scale_log2 = scale * LOG2E;
    const int row_in_block = warp * 16 + group;
    unsigned long long rows[2] = {0, 0};  // dropout's counters of this thread's rows at key 0
    bool grouped = false;
    if (DROPOUT) {
        const unsigned long long head = dropout.head_counter(b, h);
        rows[0] = dropout.row_counter(head, m0 + row_in_block, t_len);
        rows[1] = dropout.row_counter(head, m0 + row_in_block + 8, t_len);
        grouped = dropout.groups_possible();
    }

    tile<T, D>(sq, q, qs.row, t_len - m0);
    if (n_tiles > 0)
        tile<T, D>(sk, k, ks.row, s_len);
    cp_async_commit();
    if (n_tiles > 0)
        tile<T, D>(sv, v, vs.row, s_len);
    cp_async_commit();

#if !FLASH_HOPPER
    unsigned qf[D / 16][4];  // this warp's q fragments
#endif
    float acc[D / 8][4];
    zero(acc);
    float row_max[2] = {negative_infinity<float>(), negative_infinity<float>()};
    float row_sum[2] = {0.f, 0.f};  // this thread's columns only, summed over the quad at the end

    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BLOCK_N;
        cp_async_wait<1>();  // q and this key tile
        tiles_ready();
        // s = q kᵀ for this warp's 16 queries and the tile's 64 keys
        float s[BLOCK_N / 8][4];
#if FLASH_HOPPER
        // the warpgroup's 64 queries: 16 of D a step, 32 bytes along the swizzled rows
        warpgroup_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const unsigned at = kk / 4 * SWIZZLE_TILE * 2 + kk % 4 * 32;
            product_ss<T, BLOCK_N, 0>(s, descriptor(shared_address(sq), 16, 1024) + at / 16,
                                      descriptor(shared_address(sk), 16, 1024) + at / 16, kk);
        }
        warpgroup_commit_and_wait();
        pin(s);
#else
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                ldmatrix_x4(qf[kk], sq + a_rows(warp * 16, kk * 16, STRIDE, lane));
        }
        zero(s);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < BLOCK_N / 16; ++np) {
                unsigned kb[4];
                ldmatrix_x4(kb, sk + b_rows(np * 16, kk * 16, STRIDE, lane));
                mma<T>(s[2 * np], qf[kk], kb[0], kb[1]);
                mma<T>(s[2 * np + 1], qf[kk], kb[2], kb[3]);
            }
        }
#endif
        // mask keys past the end and (causal) above the diagonal
        const bool edge = n0 + BLOCK_N > s_len || (causal && n0 + BLOCK_N - 1 > m0 + diagonal);
        if (edge) {
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int row = m0 + row_in_block + (c / 2) * 8;
                    const int col = n0 + nt * 8 + quad * 2 + c % 2;
                    if (col >= s_len || (causal && col > row + diagonal))
                        s[nt][c] = negative_infinity<float>();
                }
            }
        }
        unsigned kept[4];
        if (DROPOUT) {
            const unsigned drawn = forward_keeps(kept, dropout, grouped, rows, n0, quad, s_len);
            const int t = m0 + row_in_block + 8 * (quad / 2);
            if (DROPOUT == 1 && dropout.mask && grouped && t < t_len)
                *reinterpret_cast<unsigned*>(dropout.mask_row(bh, t, t_len) + n0 / 8 +
                                             4 * (quad % 2)) = drawn;
        }
        // online softmax (raw scores; the scale goes into the exponent): new running max,
        // rescale what was summed so far
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float m = row_max[r];
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt)
                m = fmaxf(m, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            const float shift = (m == negative_infinity<float>() ? 0.f : m) * scale_log2;
            const float correction = fast_exp2(row_max[r] * scale_log2 - shift);
            row_max[r] = m;
            row_sum[r] *= correction;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                acc[dt][2 * r] *= correction;
                acc[dt][2 * r + 1] *= correction;
            }
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
                for (int c = 2 * r; c < 2 * r + 2; ++c) {
                    float p = fast_exp2(fmaf(s[nt][c], scale_log2, -shift));
                    row_sum[r] += p;
                    if (DROPOUT)
                        p = forward_dropped(kept, nt, c, p);
                    s[nt][c] = p;
                }
            }
        }
        cp_async_wait<0>();  // this value tile
        tiles_ready();       // and every warp is done with the key tile
        if (j + 1 < n_tiles)
            tile<T, D>(sk, k + (n0 + BLOCK_N) * ks.row, ks.row, s_len - n0 - BLOCK_N);
        cp_async_commit();
        // acc += p v: the score accumulators of two key octets are the A fragment of 16 keys
#if FLASH_HOPPER
        // v read N-major: 16 keys (rows of 128 bytes) a step, the tiles of D 64 rows apart
        unsigned pa[BLOCK_N / 16][4];
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            accumulators_as_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
        pin(pa);
        warpgroup_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            product_rs<T, D>(acc, pa[kk],
                             descriptor(shared_address(sv), SWIZZLE_TILE * 2, 1024) + kk * 128);
        warpgroup_commit_and_wait();
        pin(acc);
#else
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            unsigned pa[4];
            accumulators_as_a<T>(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, sv + bt_rows(kk * 16, dp * 16, STRIDE, lane));
                mma<T>(acc[2 * dp], pa, vb[0], vb[1]);
                mma<T>(acc[2 * dp + 1], pa, vb[2], vb[3]);
            }
        }
#endif
        __syncthreads();  // every warp is done with the value tile
        if (j + 1 < n_tiles)
            tile<T, D>(sv, v + (n0 + BLOCK_N) * vs.row, vs.row, s_len - n0 - BLOCK_N);
        cp_async_commit();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = row_sum[r];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const int row = m0 + row_in_block + r * 8;
        if (row >= t_len)
            continue;
        const float inverse = total > 0.f ? (DROPOUT ? dropout.scale : 1.f) / total : 0.f;
        T* out = o + row * os.row + quad * 2;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            *reinterpret_cast<unsigned*>(out + dt * 8) =
                pack<T>(acc[dt][2 * r] * inverse, acc[dt][2 * r + 1] * inverse);
        if (quad == 0)
            lse[static_cast<long long>(bh) * t_len + row] =
                total > 0.f ? (row_max[r] * scale_log2 + __log2f(total)) * LN2
                            : negative_infinity<float>();
    }
}

// ---- backward ---------------------------------------------------------------------------------
// delta[b, h, t] = sum_d do[b, h, t, d] o[b, h, t, d], and the row's float32 dq sums zeroed for
// the key blocks' additions: D / 8 lanes a row, each one 16-byte load of o and of do
template <typename T, int D>
__device__ void backward_delta(const T* o, const T* dout, float* delta, float* dq_accum,
                               int heads, int t_len, Strides os, Strides dos)
{
    constexpr int LANES = D / 8, ROWS = THREADS / LANES;
    const int row = blockIdx.x * ROWS + threadIdx.x / LANES, lane = threadIdx.x % LANES;
    const bool valid = row < t_len;      // no early return: the row's lanes shuffle below
    const int b = blockIdx.y / heads, h = blockIdx.y % heads;
    uint4 ov = make_uint4(0, 0, 0, 0), dv = ov;
    if (valid) {
        ov = *reinterpret_cast<const uint4*>(o + b * os.batch + h * os.head + row * os.row +
                                             lane * 8);
        dv = *reinterpret_cast<const uint4*>(dout + b * dos.batch + h * dos.head +
                                             row * dos.row + lane * 8);
    }
    const T* ox = reinterpret_cast<const T*>(&ov);
    const T* dx = reinterpret_cast<const T*>(&dv);
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i)
        total += widen<float>(ox[i]) * widen<float>(dx[i]);
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset >>= 1)
        total += __shfl_xor_sync(0xffffffffu, total, offset);
    if (!valid)
        return;
    const long long at = static_cast<long long>(blockIdx.y) * t_len + row;
    if (lane == 0)
        delta[at] = total;
    float4* sums = reinterpret_cast<float4*>(dq_accum + at * D + lane * 8);
    sums[0] = sums[1] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// dq[b, h, t, d] = scale dq_accum[b, h, t, d] in T; eight elements a thread (two 16-byte loads,
// one 16-byte store where dq's row allows it)
template <typename T, int D>
__device__ void backward_dq(const float* dq_accum, T* dq, int heads, int t_len, Strides dqs,
                            float scale)
{
    const long long i = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
    const long long bh = blockIdx.y;
    if (i >= static_cast<long long>(t_len) * D)
        return;
    const int row = static_cast<int>(i / D), d = static_cast<int>(i % D);
    const int b = static_cast<int>(bh / heads), h = static_cast<int>(bh % heads);
    const float4* sums = reinterpret_cast<const float4*>(dq_accum + bh * t_len * D + i);
    const float4 lo = sums[0], hi = sums[1];
    const uint4 packed = make_uint4(pack<T>(scale * lo.x, scale * lo.y),
                                    pack<T>(scale * lo.z, scale * lo.w),
                                    pack<T>(scale * hi.x, scale * hi.y),
                                    pack<T>(scale * hi.z, scale * hi.w));
    T* out = dq + b * dqs.batch + h * dqs.head + row * dqs.row + d;
    if (reinterpret_cast<size_t>(out) % 16 == 0) {
        *reinterpret_cast<uint4*>(out) = packed;
    } else {
        const T* values = reinterpret_cast<const T*>(&packed);
#pragma unroll
        for (int j = 0; j < 8; ++j)
            out[j] = values[j];
    }
}

template <typename T, int D, int DROPOUT>
__device__ void backward(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                         const float* delta, float* dq_accum, T* dk, T* dv, int heads,
                         int kv_heads, int kv_group, int kv_offset, int t_len, int s_len,
                         Strides qs, Strides ks, Strides vs, Strides dos, Strides dks,
                         Strides dvs, float scale, bool causal,
                         const Dropout<DROPOUT == 2>& dropout)
{
#if FLASH_HOPPER
    // swizzled tiles (64 columns a tile, ROWS rows each); the warpgroups take 64 keys each
    constexpr int STRIDE = D, DS_STRIDE = BLOCK_M;
    T* sk = reinterpret_cast<T*>(swizzle_aligned_shared());
#else
    constexpr int STRIDE = D + PAD, DS_STRIDE = BLOCK_M + PAD;
    T* sk = reinterpret_cast<T*>(shared);
#endif
    T* sv = sk + BACKWARD_BLOCK_N * STRIDE;
    // q and do of a query tile in two buffers: the next tile loads while this one is used
    T* const sq_buffers = sv + BACKWARD_BLOCK_N * STRIDE;  // q, do, q, do
    T* sds = sq_buffers + 4 * BLOCK_M * STRIDE;  // dsᵀ: keys x queries
    float* slse = reinterpret_cast<float*>(sds + BACKWARD_BLOCK_N * DS_STRIDE);  // log2, +inf: no P
    float* sdelta = slse + BLOCK_M;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, quad = lane % 4;
    // a block of keys of every (b, key/value head), the first (the longest, causal) first
    const int n0 = blockIdx.y * BACKWARD_BLOCK_N;
    const int b = blockIdx.x / kv_heads, kv = blockIdx.x % kv_heads;
    // the query heads h that read key/value head kv: (h + kv_offset) / kv_group == kv
    const int h_begin = max(0, kv * kv_group - kv_offset);
    const int h_end = min(heads, (kv + 1) * kv_group - kv_offset);
    k += b * ks.batch + kv * ks.head + n0 * ks.row;
    v += b * vs.batch + kv * vs.head + n0 * vs.row;
    dk += b * dks.batch + kv * dks.head + n0 * dks.row;
    dv += b * dvs.batch + kv * dvs.head + n0 * dvs.row;
    const int diagonal = s_len - t_len;
    const int m_tiles = (t_len + BLOCK_M - 1) / BLOCK_M;
    const int m_begin = causal ? max(0, n0 - diagonal) / BLOCK_M : 0;  // first tile seeing key n0
    const float scale_log2 = scale * LOG2E;
    const int key_in_block = warp * 16 + group;
    // the query head being walked: its q, do, lse, delta, dq sums and dropout counter
    const T *q_head = q, *dout_head = dout;
    const float *lse_head = lse, *delta_head = delta;
    float* dq_head = dq_accum;
    unsigned long long counter0 = 0;
    const unsigned char* stored = nullptr;  // the forward's kept bits of this head
    const bool grouped = DROPOUT && dropout.groups_possible();

    static_assert(BLOCK_M <= BACKWARD_THREADS, "a thread per query row's lse and delta");
    auto load_rows = [&](int m0, int buffer) {  // q and do of the query tile at m0
        T* to = sq_buffers + 2 * buffer * BLOCK_M * STRIDE;
        tile<T, D, BLOCK_M, BACKWARD_THREADS>(to, q_head + m0 * qs.row, qs.row, t_len - m0);
        tile<T, D, BLOCK_M, BACKWARD_THREADS>(to + BLOCK_M * STRIDE, dout_head + m0 * dos.row,
                                              dos.row, t_len - m0);
        cp_async_commit();
    };
    // lse and delta of the query tile at m0: read into registers early (thread i, row i), put
    // into shared memory once the tile before is done with them
    float row_lse = 0.f, row_delta = 0.f;
    auto fetch_stats = [&](int m0) {
        const int t = m0 + threadIdx.x;
        if (threadIdx.x < BLOCK_M) {
            row_lse = t < t_len ? lse_head[t] : negative_infinity<float>();
            row_delta = t < t_len ? delta_head[t] : 0.f;
        }
    };
    auto store_stats = [&]() {
        if (threadIdx.x < BLOCK_M) {
            slse[threadIdx.x] = row_lse == negative_infinity<float>() ? -negative_infinity<float>()
                                                                       : row_lse * LOG2E;
            sdelta[threadIdx.x] = row_delta;
        }
    };

    float dk_acc[D / 8][4], dv_acc[D / 8][4];
    zero(dk_acc);
    zero(dv_acc);
    tile<T, D, BACKWARD_BLOCK_N, BACKWARD_THREADS>(sk, k, ks.row, s_len - n0);
    tile<T, D, BACKWARD_BLOCK_N, BACKWARD_THREADS>(sv, v, vs.row, s_len - n0);
    cp_async_commit();

    // dk and dv sum over the group's query heads; after a head's last tile only sds and sk are
    // read, so the next head's first tile may load at once (its first sync orders the rest)
    for (int h = h_begin; h < h_end; ++h) {
        const long long bh = static_cast<long long>(b) * heads + h;
        q_head = q + b * qs.batch + h * qs.head;
        dout_head = dout + b * dos.batch + h * dos.head;
        lse_head = lse + bh * t_len;
        delta_head = delta + bh * t_len;
        dq_head = dq_accum + bh * t_len * D;
        if (DROPOUT) {
            counter0 = dropout.head_counter(b, h);
            if (DROPOUT == 1 && dropout.mask && grouped)
                stored = dropout.mask_row(bh, 0, t_len);
        }
        if (m_begin < m_tiles) {
            load_rows(m_begin * BLOCK_M, 0);
            fetch_stats(m_begin * BLOCK_M);
            store_stats();
        }

        for (int i = m_begin; i < m_tiles; ++i) {
            const int m0 = i * BLOCK_M;
            cp_async_wait<0>();
            tiles_ready();
            const T* sq = sq_buffers + 2 * ((i - m_begin) % 2) * BLOCK_M * STRIDE;
            const T* sdo = sq + BLOCK_M * STRIDE;
            if (i + 1 < m_tiles) {  // into the other buffers, which no warp reads any more
                load_rows(m0 + BLOCK_M, (i - m_begin + 1) % 2);
                fetch_stats(m0 + BLOCK_M);
            }
            // sᵀ = k qᵀ and dpᵀ = v doᵀ: this warp's 16 keys x the tile's 64 queries
            float st[BLOCK_M / 8][4], dpt[BLOCK_M / 8][4];
#if FLASH_HOPPER
            // the warpgroup's 64 keys (tile rows 64 (warp / 4) ..): 16 of D a step
            warpgroup_fence();
    #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const unsigned at = kk / 4 * BACKWARD_BLOCK_N * 128 + warp / 4 * 64 * 128 + kk % 4 * 32;
                const unsigned rows_at = kk / 4 * BLOCK_M * 128 + kk % 4 * 32;
                product_ss<T, BLOCK_M, 0>(st, descriptor(shared_address(sk), 16, 1024) + at / 16,
                                          descriptor(shared_address(sq), 16, 1024) + rows_at / 16,
                                          kk);
                product_ss<T, BLOCK_M, 0>(dpt, descriptor(shared_address(sv), 16, 1024) + at / 16,
                                          descriptor(shared_address(sdo), 16, 1024) + rows_at / 16,
                                          kk);
            }
            warpgroup_commit_and_wait();
            pin(st);
            pin(dpt);
#else
            zero(st);
            zero(dpt);
    #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned ka[4], va[4];
                const int a_offset = a_rows(warp * 16, kk * 16, STRIDE, lane);
                ldmatrix_x4(ka, sk + a_offset);
                ldmatrix_x4(va, sv + a_offset);
    #pragma unroll
                for (int np = 0; np < BLOCK_M / 16; ++np) {
                    const int b_offset = b_rows(np * 16, kk * 16, STRIDE, lane);
                    unsigned qb[4], dob[4];
                    ldmatrix_x4(qb, sq + b_offset);
                    ldmatrix_x4(dob, sdo + b_offset);
                    mma<T>(st[2 * np], ka, qb[0], qb[1]);
                    mma<T>(st[2 * np + 1], ka, qb[2], qb[3]);
                    mma<T>(dpt[2 * np], va, dob[0], dob[1]);
                    mma<T>(dpt[2 * np + 1], va, dob[2], dob[3]);
                }
            }
#endif
            // pᵀ from lse, then st <- dropped pᵀ and dpt <- dsᵀ = pᵀ (dpᵀ - delta)
            const bool edge = n0 + BACKWARD_BLOCK_N > s_len ||
                              (causal && n0 + BACKWARD_BLOCK_N - 1 > m0 + diagonal);
            unsigned kept[BLOCK_M / 8];
            if (DROPOUT)
                backward_keeps(kept, dropout, grouped,
                               [&](int t) { return dropout.row_counter(counter0, t, t_len); },
                               stored, m0, n0 + warp * 16, group, quad, t_len, s_len);
    #pragma unroll
            for (int nt = 0; nt < BLOCK_M / 8; ++nt) {
    #pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int key = n0 + key_in_block + (c / 2) * 8;
                    const int t_in_tile = nt * 8 + quad * 2 + c % 2;
                    const int t = m0 + t_in_tile;
                    float p = fast_exp2(fmaf(st[nt][c], scale_log2, -slse[t_in_tile]));
                    if (edge && (key >= s_len || (causal && key > t + diagonal)))
                        p = 0.f;
                    float dp = dpt[nt][c];
                    float kept_p = p;
                    if (DROPOUT)
                        backward_dropped(kept, nt, c, dropout.scale, kept_p, dp);
                    st[nt][c] = kept_p;
                    dpt[nt][c] = p * (dp - sdelta[t_in_tile]);
                }
            }
            // dv += pᵀ do and dk += dsᵀ q (A fragments straight from the accumulators)
#if FLASH_HOPPER
            // do and q read N-major: 16 queries a step, the tiles of D 64 rows apart
            unsigned pa[BLOCK_M / 16][4], dsa[BLOCK_M / 16][4];
    #pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
                accumulators_as_a<T>(pa[kk], st[2 * kk], st[2 * kk + 1]);
                accumulators_as_a<T>(dsa[kk], dpt[2 * kk], dpt[2 * kk + 1]);
            }
            pin(pa);
            pin(dsa);
            warpgroup_fence();
    #pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
                product_rs<T, D>(dv_acc, pa[kk],
                                 descriptor(shared_address(sdo), BLOCK_M * 128, 1024) + kk * 128);
                product_rs<T, D>(dk_acc, dsa[kk],
                                 descriptor(shared_address(sq), BLOCK_M * 128, 1024) + kk * 128);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            // dsᵀ to shared memory for dq (swizzled: 64 queries, 128 bytes, a key row)
    #pragma unroll
            for (int nt = 0; nt < BLOCK_M / 8; ++nt) {
    #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int key = key_in_block + r * 8;
                    *reinterpret_cast<unsigned*>(sds + key * 64 + (nt ^ key % 8) * 8 + quad * 2) =
                        pack<T>(dpt[nt][2 * r], dpt[nt][2 * r + 1]);
                }
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            pin(dv_acc);
            pin(dk_acc);
            fence_async_shared();
#else
    #pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
                unsigned pa[4], dsa[4];
                accumulators_as_a<T>(pa, st[2 * kk], st[2 * kk + 1]);
                accumulators_as_a<T>(dsa, dpt[2 * kk], dpt[2 * kk + 1]);
    #pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    const int offset = bt_rows(kk * 16, dp * 16, STRIDE, lane);
                    unsigned dob[4], qb[4];
                    ldmatrix_x4_trans(dob, sdo + offset);
                    ldmatrix_x4_trans(qb, sq + offset);
                    mma<T>(dv_acc[2 * dp], pa, dob[0], dob[1]);
                    mma<T>(dv_acc[2 * dp + 1], pa, dob[2], dob[3]);
                    mma<T>(dk_acc[2 * dp], dsa, qb[0], qb[1]);
                    mma<T>(dk_acc[2 * dp + 1], dsa, qb[2], qb[3]);
                }
            }
            // dsᵀ to shared memory for dq, which needs all the block's keys per query
    #pragma unroll
            for (int nt = 0; nt < BLOCK_M / 8; ++nt) {
    #pragma unroll
                for (int r = 0; r < 2; ++r)
                    *reinterpret_cast<unsigned*>(sds + (key_in_block + r * 8) * DS_STRIDE + nt * 8 +
                                                 quad * 2) =
                        pack<T>(dpt[nt][2 * r], dpt[nt][2 * r + 1]);
            }
#endif
            __syncthreads();  // dsᵀ complete; q, do, lse and delta of this tile no longer read
            if (i + 1 < m_tiles)
                store_stats();
            // dq of 16 queries (warp % 4) x half of D (warp / 4) += ds k over the block's keys
            constexpr int HALF = D / 16 / 2;  // 16-column chunks of D per warp
            const int dq_rows = (warp % 4) * 16, dq_chunk0 = (warp / 4) * HALF;
            float dq[2 * HALF][4];
#if FLASH_HOPPER
            // dsᵀ and k read M-/N-major: 16 keys a step; this warpgroup's half of D starts
            // 64 (warp / 4) bytes into k's swizzled rows at D = 64, at its second tile at 128
            warpgroup_fence();
    #pragma unroll
            for (int kk = 0; kk < BACKWARD_BLOCK_N / 16; ++kk) {
                const unsigned half_at = D == 64 ? warp / 4 * 64 : warp / 4 * BACKWARD_BLOCK_N * 128;
                product_ss<T, D / 2, 1>(
                    dq, descriptor(shared_address(sds), 16, 1024) + kk * 128,
                    descriptor(shared_address(sk), BACKWARD_BLOCK_N * 128, 1024) + half_at / 16 +
                        kk * 128,
                    kk);
            }
            warpgroup_commit_and_wait();
            pin(dq);
#else
            zero(dq);
    #pragma unroll
            for (int kk = 0; kk < BACKWARD_BLOCK_N / 16; ++kk) {
                unsigned dsa[4];
                ldmatrix_x4_trans(dsa, sds + b_rows(kk * 16, dq_rows, DS_STRIDE, lane));
    #pragma unroll
                for (int dp = 0; dp < HALF; ++dp) {
                    unsigned kb[4];
                    ldmatrix_x4_trans(kb, sk + bt_rows(kk * 16, (dq_chunk0 + dp) * 16, STRIDE, lane));
                    mma<T>(dq[2 * dp], dsa, kb[0], kb[1]);
                    mma<T>(dq[2 * dp + 1], dsa, kb[2], kb[3]);
                }
            }
#endif
#if __CUDA_ARCH__ >= 900
            // neighbouring lanes trade halves of their two rows, so that lane quad adds four
            // adjacent columns of row r = quad % 2 in one vector reduction
            const int r = quad % 2, t = m0 + dq_rows + group + r * 8;
            float* out = dq_head + static_cast<long long>(t) * D + dq_chunk0 * 16 + quad / 2 * 4;
    #pragma unroll
            for (int dt = 0; dt < 2 * HALF; ++dt) {
                const float got0 = __shfl_xor_sync(0xffffffffu, r ? dq[dt][0] : dq[dt][2], 1);
                const float got1 = __shfl_xor_sync(0xffffffffu, r ? dq[dt][1] : dq[dt][3], 1);
                if (t < t_len) {
                    if (r)
                        red_add4(out + dt * 8, got0, got1, dq[dt][2], dq[dt][3]);
                    else
                        red_add4(out + dt * 8, dq[dt][0], dq[dt][1], got0, got1);
                }
            }
#else
    #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int t = m0 + dq_rows + group + r * 8;
                if (t >= t_len)
                    continue;
                float* out = dq_head + static_cast<long long>(t) * D + dq_chunk0 * 16 + quad * 2;
    #pragma unroll
                for (int dt = 0; dt < 2 * HALF; ++dt) {
                    atomicAdd(out + dt * 8, dq[dt][2 * r]);
                    atomicAdd(out + dt * 8 + 1, dq[dt][2 * r + 1]);
                }
            }
#endif
        }
    }
    cp_async_wait<0>();

    const float dv_scale = DROPOUT ? dropout.scale : 1.f;  // the kept probabilities' 1 / (1 - p)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key_in_block + r * 8;
        if (n0 + key >= s_len)
            continue;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            *reinterpret_cast<unsigned*>(dk + key * dks.row + dt * 8 + quad * 2) =
                pack<T>(scale * dk_acc[dt][2 * r], scale * dk_acc[dt][2 * r + 1]);
            *reinterpret_cast<unsigned*>(dv + key * dvs.row + dt * 8 + quad * 2) =
                pack<T>(dv_scale * dv_acc[dt][2 * r], dv_scale * dv_acc[dt][2 * r + 1]);
        }
    }
}

}  // namespace flash

// ---- entry points: flash_<kind>_d<D>[_dropout]_<dtype> ----------------------------------------
// Strides and dropout come as plain scalars (three strides per tensor: batch, head, row).
#define FLASH_STRIDES(X) long long X##_batch, long long X##_head, long long X##_row
#define FLASH_MAKE_STRIDES(X) flash::Strides{X##_batch, X##_head, X##_row}
#define FLASH_DROPOUT_PARAMS                                                                       \
    unsigned long long threshold, float keep_scale, unsigned long long seed,                      \
        const unsigned long long *base, unsigned long long add, int heads_global,                 \
        int head_offset, int batch_offset, const long long *rows, const long long *cols,          \
        long long t_global, long long s_global, unsigned char *mask, long long mask_pitch
#define FLASH_MAKE_DROPOUT(DROPOUT)                                                                \
    flash::Dropout<(DROPOUT) == 2>{threshold,    keep_scale, seed,     base,     add,             \
                                   heads_global, head_offset, batch_offset, rows, cols,           \
                                   t_global,     s_global,   mask,     mask_pitch}

#define FLASH_ATTENTION_KERNELS(T, SUFFIX, D, DROPOUT, TAG)                                        \
    extern "C" __global__ void __launch_bounds__(flash::THREADS, FLASH_FORWARD_BLOCKS(D, DROPOUT)) \
        flash_forward_d##D##TAG##_##SUFFIX(                                                        \
        const T* q, const T* k, const T* v, T* o, float* lse, int heads, int kv_group,            \
        int kv_offset, int t_len, int s_len, FLASH_STRIDES(qs), FLASH_STRIDES(ks),                \
        FLASH_STRIDES(vs), FLASH_STRIDES(os), float scale, int causal, FLASH_DROPOUT_PARAMS)       \
    {                                                                                              \
        flash::forward<T, D, DROPOUT>(q, k, v, o, lse, heads, kv_group, kv_offset, t_len, s_len,  \
                                      FLASH_MAKE_STRIDES(qs), FLASH_MAKE_STRIDES(ks),             \
                                      FLASH_MAKE_STRIDES(vs), FLASH_MAKE_STRIDES(os), scale,      \
                                      causal != 0, FLASH_MAKE_DROPOUT(DROPOUT));                   \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(flash::BACKWARD_THREADS, FLASH_BACKWARD_BLOCKS(D)) \
        flash_backward_d##D##TAG##_##SUFFIX(                                                       \
            const T* q, const T* k, const T* v, const T* dout, const float* lse,                  \
            const float* delta, float* dq_accum, T* dk, T* dv, int heads, int kv_heads,           \
            int kv_group, int kv_offset, int t_len, int s_len, FLASH_STRIDES(qs),                 \
            FLASH_STRIDES(ks), FLASH_STRIDES(vs), FLASH_STRIDES(dos), FLASH_STRIDES(dks),         \
            FLASH_STRIDES(dvs), float scale, int causal, FLASH_DROPOUT_PARAMS)                    \
    {                                                                                              \
        flash::backward<T, D, DROPOUT>(                                                            \
            q, k, v, dout, lse, delta, dq_accum, dk, dv, heads, kv_heads, kv_group, kv_offset,     \
            t_len, s_len,                                                                          \
            FLASH_MAKE_STRIDES(qs), FLASH_MAKE_STRIDES(ks), FLASH_MAKE_STRIDES(vs),               \
            FLASH_MAKE_STRIDES(dos), FLASH_MAKE_STRIDES(dks), FLASH_MAKE_STRIDES(dvs), scale,     \
            causal != 0, FLASH_MAKE_DROPOUT(DROPOUT));                                             \
    }

#define FLASH_ATTENTION_HELPERS(T, SUFFIX, D)                                                     \
    extern "C" __global__ void flash_backward_delta_d##D##_##SUFFIX(                              \
        const T* o, const T* dout, float* delta, float* dq_accum, int heads, int t_len,           \
        FLASH_STRIDES(os), FLASH_STRIDES(dos))                                                     \
    {                                                                                              \
        flash::backward_delta<T, D>(o, dout, delta, dq_accum, heads, t_len,                       \
                                    FLASH_MAKE_STRIDES(os), FLASH_MAKE_STRIDES(dos));              \
    }                                                                                              \
    extern "C" __global__ void flash_backward_dq_d##D##_##SUFFIX(                                 \
        const float* dq_accum, T* dq, int heads, int t_len, FLASH_STRIDES(dqs), float scale)      \
    {                                                                                              \
        flash::backward_dq<T, D>(dq_accum, dq, heads, t_len, FLASH_MAKE_STRIDES(dqs), scale);      \
    }

#define FLASH_ATTENTION_DTYPE(T, SUFFIX, D)                                                       \
    FLASH_ATTENTION_KERNELS(T, SUFFIX, D, 0, )                                                     \
    FLASH_ATTENTION_KERNELS(T, SUFFIX, D, 1, _dropout)                                             \
    FLASH_ATTENTION_KERNELS(T, SUFFIX, D, 2, _dropout_at)                                          \
    FLASH_ATTENTION_HELPERS(T, SUFFIX, D)

// One head dimension per compilation (the launcher passes -DFLASH_HEAD_DIM=64 or 128).
FLASH_ATTENTION_DTYPE(__nv_bfloat16, bf16, FLASH_HEAD_DIM)
FLASH_ATTENTION_DTYPE(__half, f16, FLASH_HEAD_DIM)
