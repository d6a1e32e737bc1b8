// The attention kernels of vendor/patches/ggml-cpu-flash-attn-blocks.patch alone, one thread:
// ROWS query rows of each of HQ heads (HKV K/V heads) over N_KV cells of head size D, 30 times
// (a model's layers), as one step's attention; rows in the order ggml gives them (a head's
// rows, then the next head's). kernel_bench.sh extracts the kernels from a revision of the
// patch and builds this against the pinned llama.cpp's headers; ROW_KERNEL selects the
// one-row API of the patch before 027e384.
#include "vec.h"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "kernel.inc"

// What the kernels take from ggml's libraries: its abort and its F16 -> F32 table.
extern "C" void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "%s:%d: %s\n", file, line, fmt);
    abort();
}
float ggml_table_f32_f16[1 << 16];  // declared extern "C" by simd-mappings.h

int main(int argc, char ** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s D HQ HKV ROWS N_KV\n", argv[0]);
        return 1;
    }
    const int D = atoi(argv[1]), HQ = atoi(argv[2]), HKV = atoi(argv[3]), ROWS = atoi(argv[4]), N_KV = atoi(argv[5]);
    const int LAYERS = 30;
    for (int i = 0; i < (1 << 16); ++i) {
        ggml_table_f32_f16[i] = _cvtsh_ss((uint16_t) i);
    }
    const size_t nb1 = (size_t) HKV*D*sizeof(ggml_fp16_t);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<ggml_fp16_t> K((size_t) N_KV*HKV*D), V((size_t) N_KV*HKV*D);
    for (auto & x : K) x = GGML_CPU_FP32_TO_FP16(0.5f*normal(rng));
    for (auto & x : V) x = GGML_CPU_FP32_TO_FP16(normal(rng));
    std::vector<float> Q((size_t) ROWS*HQ*D);
    for (auto & x : Q) x = 0.3f*normal(rng);
    std::vector<ggml_fp16_t> mask((size_t) ROWS*N_KV);  // causal over the last ROWS cells
    for (int r = 0; r < ROWS; ++r) {
        for (int j = 0; j < N_KV; ++j) {
            mask[(size_t) r*N_KV + j] = j <= N_KV - ROWS + r ? GGML_CPU_FP32_TO_FP16(0.0f) : (ggml_fp16_t) 0xFC00;
        }
    }
    std::vector<float> out((size_t) ROWS*HQ*D);
    const float scale = 1.0f/sqrtf((float) D);
    auto kv_of = [&](int h) { return h/(HQ/HKV); };  // head h's K/V head
    auto kv_head = [&](const std::vector<ggml_fp16_t> & x, int h) {  // head h's K or V, cell 0
        return (const char *) x.data() + (size_t) kv_of(h)*D*sizeof(ggml_fp16_t);
    };
    double best = 1e30;
    for (int rep = 0; rep < 30; ++rep) {  // the best of 30: the machine is noisy
        const auto start = std::chrono::steady_clock::now();
        for (int layer = 0; layer < LAYERS; ++layer) {
#if defined(ROW_KERNEL)
            for (int ir = 0; ir < ROWS*HQ; ++ir) {
                const int r = ir % ROWS, h = ir / ROWS;
                float M, S;
                cllm_fa_row_f16(&Q[((size_t) r*HQ + h)*D], kv_head(K, h), nb1, kv_head(V, h), nb1, &mask[(size_t) r*N_KV],
                        1.0f, D, D, 0, N_KV, scale, 0.0f, &out[((size_t) r*HQ + h)*D], &M, &S);
            }
#else
            // As ggml's loop groups them: consecutive rows (a head's rows, then the next head's)
            // over the same K/V head, up to the head size's group.
            for (int ir = 0; ir < ROWS*HQ;) {
                cllm_fa_rows rows;
                rows.count = 0;
                const int first_head = ir / ROWS;
                while (ir < ROWS*HQ && rows.count < cllm_fa_group_size(D) && kv_of(ir / ROWS) == kv_of(first_head)) {
                    const int r = ir % ROWS, h = ir / ROWS, g = rows.count++;
                    rows.q[g] = &Q[((size_t) r*HQ + h)*D];
                    rows.mp[g] = &mask[(size_t) r*N_KV];
                    rows.slope[g] = 1.0f;
                    rows.VKQ[g] = &out[((size_t) r*HQ + h)*D];
                    ++ir;
                }
                cllm_fa_attend(rows, D, kv_head(K, first_head), nb1, kv_head(V, first_head), nb1, 0, N_KV, scale, 0.0f);
            }
#endif
        }
        best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    printf("D %d, %d heads over %d, %d rows, %d cells: %.2f ms\n", D, HQ, HKV, ROWS, N_KV, best);
    return 0;
}
