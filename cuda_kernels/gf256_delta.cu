// GF(2^8) parity delta kernel for ECRec (polynomial 0x11d, the field of ISA-L / pyeclib).
//
// Loaded at run time by ecrec/kernels/gpu.py through cupy.RawModule; compiles on its own
// with `nvcc -ptx -arch=compute_90 cuda_kernels/gf256_delta.cu`.
//
// For every batch row r:   parity[slots[r]] ^= coeff[r] * delta[r]      (bytewise, GF(2^8))
//
// Layout: blockIdx.y walks batch rows (grid-stride, so any batch size), blockIdx.x and
// threadIdx.x walk 4-byte words of a row (grid-stride, so any width).  Each block copies
// the 256-byte multiplication row of its current coefficient from the global 256x256
// table into shared memory, then every thread multiplies one 32-bit word per step with
// four shared-memory lookups.  Results go in with atomicXor on 32-bit words, so several
// batch rows hitting the same parity slot (duplicate slots) all accumulate.  Rows whose
// parity or delta address is not 4-byte aligned, and the last partial word of a row,
// take a byte path that XORs each byte into its aligned containing word (atomicXor with
// the byte shifted into place), which leaves the neighbouring bytes untouched.

// No #include: NVRTC (cupy.RawModule) has no standard headers; addresses use unsigned long long.

extern "C" __global__ void gf256_delta_batch(
    unsigned char* __restrict__ parity,  // (rows, parity_stride) bytes
    long long parity_stride,             // bytes between parity rows
    const unsigned char* __restrict__ delta,  // (batch, delta_stride) bytes
    long long delta_stride,              // bytes between delta rows (0: one delta broadcast)
    const long long* __restrict__ slots, // (batch,) parity row of each delta row
    const unsigned char* __restrict__ coeffs,  // (batch,) coefficient of each delta row
    const unsigned char* __restrict__ mul_table,  // (256, 256): mul_table[c][x] = c*x
    long long batch,
    long long width)
{
    __shared__ unsigned char row_table[256];
    const long long words = (width + 3) / 4;
    const long long word_step = (long long)gridDim.x * blockDim.x;

    for (long long r = blockIdx.y; r < batch; r += gridDim.y) {
        const unsigned int c = coeffs[r];
        if (c == 0) {
            continue;  // uniform across the block: no thread reaches the barriers below
        }
        __syncthreads();  // previous row's table no longer in use
        for (int t = threadIdx.x; t < 256; t += blockDim.x) {
            row_table[t] = mul_table[c * 256 + t];
        }
        __syncthreads();

        unsigned char* p = parity + slots[r] * parity_stride;
        const unsigned char* d = delta + r * delta_stride;
        const bool aligned = ((((unsigned long long)p) | ((unsigned long long)d)) & 3ULL) == 0;

        for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += word_step) {
            const long long i = 4 * w;
            if (aligned && i + 4 <= width) {
                const unsigned int x = *reinterpret_cast<const unsigned int*>(d + i);
                const unsigned int y = (unsigned int)row_table[x & 0xff]
                                     | ((unsigned int)row_table[(x >> 8) & 0xff] << 8)
                                     | ((unsigned int)row_table[(x >> 16) & 0xff] << 16)
                                     | ((unsigned int)row_table[x >> 24] << 24);
                if (y != 0) {
                    atomicXor(reinterpret_cast<unsigned int*>(p + i), y);
                }
            } else {
                for (long long q = i; q < i + 4 && q < width; ++q) {
                    const unsigned int y = row_table[d[q]];
                    if (y != 0) {
                        const unsigned long long a = (unsigned long long)(p + q);
                        atomicXor(reinterpret_cast<unsigned int*>(a & ~3ULL), y << (8 * (a & 3)));
                    }
                }
            }
        }
    }
}
