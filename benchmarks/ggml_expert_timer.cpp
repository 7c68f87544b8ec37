// Times llama.cpp's CPU expert FFN through ggml (libggml of bench_peers' llama.cpp build),
// for launch/bench_host.py.
//
//   ggml_expert_timer D I E K THREADS ITERS
//
// E SwiGLU experts of hidden D and intermediate I, BF16 weights (gate, up [I, D], down
// [D, I] per expert, random), one F32 token. K == 1: one expert as ggml_mul_mat (gate),
// ggml_mul_mat (up), ggml_swiglu_split, ggml_mul_mat (down), then the gate weight
// (ggml_mul). K > 1: llama.cpp's MoE FFN (llm_graph_context::build_moe_ffn): ggml_mul_mat_id
// for gate, up and down over the K selected experts, ggml_swiglu_split, the weights
// (ggml_mul) and the sum of the K outputs (ggml_add of views). ggml_graph_compute with
// THREADS threads on one persistent threadpool (as llama.cpp's CPU backend with a
// threadpool). Call i uses experts (i*K .. i*K+K-1) mod E, so with E*expert bytes above
// the last-level cache every call reads its weights from memory, as a decode step does.
// After a warm-up of E calls, prints one JSON line: per-call seconds (median, min, mean).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "ggml.h"
#include "ggml-cpu.h"

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

static void fill_bf16(ggml_tensor* t, std::mt19937& rng, float scale) {
  std::normal_distribution<float> nd(0.0f, scale);
  ggml_bf16_t* p = static_cast<ggml_bf16_t*>(t->data);
  for (int64_t i = 0; i < ggml_nelements(t); ++i) p[i] = ggml_fp32_to_bf16(nd(rng));
}

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s D I E K THREADS ITERS\n", argv[0]);
    return 2;
  }
  const int64_t d = std::atoll(argv[1]), inter = std::atoll(argv[2]), e = std::atoll(argv[3]),
                k = std::atoll(argv[4]);
  const int threads = std::atoi(argv[5]), iters = std::atoi(argv[6]);
  if (d <= 0 || inter <= 0 || k <= 0 || e < k || threads <= 0 || iters <= 0) {
    std::fprintf(stderr, "ggml_expert_timer: need D, I, THREADS, ITERS > 0 and E >= K > 0\n");
    return 2;
  }
  ggml_cpu_init();
  const size_t weights = 3 * e * inter * d * sizeof(ggml_bf16_t);
  ggml_init_params ip = {weights + (size_t{64} << 20), nullptr, false};
  ggml_context* ctx = ggml_init(ip);
  ggml_tensor* gate = ggml_new_tensor_3d(ctx, GGML_TYPE_BF16, d, inter, e);
  ggml_tensor* up = ggml_new_tensor_3d(ctx, GGML_TYPE_BF16, d, inter, e);
  ggml_tensor* down = ggml_new_tensor_3d(ctx, GGML_TYPE_BF16, inter, d, e);
  std::mt19937 rng(0);
  fill_bf16(gate, rng, 0.02f);
  fill_bf16(up, rng, 0.02f);
  fill_bf16(down, rng, 0.02f);
  ggml_tensor* x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, 1, 1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t i = 0; i < d; ++i) static_cast<float*>(x->data)[i] = nd(rng);
  ggml_tensor* w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, k, 1);   // gate weights
  for (int64_t j = 0; j < k; ++j) static_cast<float*>(w->data)[j] = 1.0f / k;
  ggml_tensor* ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, 1);

  // graphs: K == 1, one per expert (views of its rows); K > 1, one (the ids change)
  std::vector<ggml_cgraph*> graphs;
  if (k == 1) {
    ggml_tensor* x2 = ggml_reshape_2d(ctx, x, d, 1);
    ggml_tensor* w1 = ggml_reshape_2d(ctx, w, 1, 1);
    for (int64_t ex = 0; ex < e; ++ex) {
      ggml_tensor* g = ggml_view_2d(ctx, gate, d, inter, gate->nb[1], ex * gate->nb[2]);
      ggml_tensor* u = ggml_view_2d(ctx, up, d, inter, up->nb[1], ex * up->nb[2]);
      ggml_tensor* dn = ggml_view_2d(ctx, down, inter, d, down->nb[1], ex * down->nb[2]);
      ggml_tensor* a = ggml_swiglu_split(ctx, ggml_mul_mat(ctx, g, x2), ggml_mul_mat(ctx, u, x2));
      ggml_tensor* y = ggml_mul(ctx, ggml_mul_mat(ctx, dn, a), w1);
      ggml_cgraph* gf = ggml_new_graph(ctx);
      ggml_build_forward_expand(gf, y);
      graphs.push_back(gf);
    }
  } else {
    ggml_tensor* a = ggml_swiglu_split(ctx, ggml_mul_mat_id(ctx, gate, x, ids),
                                       ggml_mul_mat_id(ctx, up, x, ids));   // [I, K, 1]
    ggml_tensor* ex = ggml_mul(ctx, ggml_mul_mat_id(ctx, down, a, ids), w);  // [D, K, 1]
    ggml_tensor* out = ggml_view_2d(ctx, ex, d, 1, ex->nb[2], 0);
    for (int64_t j = 1; j < k; ++j)
      out = ggml_add(ctx, out, ggml_view_2d(ctx, ex, d, 1, ex->nb[2], j * ex->nb[1]));
    ggml_cgraph* gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    graphs.push_back(gf);
  }

  ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
  ggml_threadpool* pool = ggml_threadpool_new(&tpp);
  std::vector<uint8_t> work;
  auto run = [&](int64_t call) {
    ggml_cgraph* gf = graphs[k == 1 ? call % e : 0];
    if (k > 1)
      for (int64_t j = 0; j < k; ++j)
        static_cast<int32_t*>(ids->data)[j] = static_cast<int32_t>((call * k + j) % e);
    ggml_cplan plan = ggml_graph_plan(gf, threads, pool);
    if (plan.work_size > work.size()) work.resize(plan.work_size);
    plan.work_data = work.data();
    if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS) {
      std::fprintf(stderr, "ggml_expert_timer: ggml_graph_compute failed\n");
      std::exit(1);
    }
  };
  for (int64_t i = 0; i < e; ++i) run(i);   // warm-up: every expert once
  std::vector<double> times(iters);
  for (int i = 0; i < iters; ++i) {
    const double t0 = now();
    run(e + i);
    times[i] = now() - t0;
  }
  double mean = 0;
  for (double t : times) mean += t / iters;
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  std::printf("{\"median_s\": %.9f, \"min_s\": %.9f, \"mean_s\": %.9f, \"iters\": %d, "
              "\"threads\": %d, \"ggml_cpu_has_avx512_bf16\": %d}\n",
              sorted[iters / 2], sorted[0], mean, iters, threads, ggml_cpu_has_avx512_bf16());
  ggml_threadpool_free(pool);
  ggml_free(ctx);
  return 0;
}
