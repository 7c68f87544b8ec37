// Read bandwidth of 1 GiB with and without MADV_HUGEPAGE (THP is madvise-only here):
// g++ -O3 -march=native -std=c++17 -pthread hugepages.cc -o hp && ./hp 0 && ./hp 1
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include <cstdlib>
typedef float v8f __attribute__((vector_size(32)));
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, 32); return v; }
inline float hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
void rows1x4(const float* w, int64_t rows, int64_t len, const float* x, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    v8f a[4] = {}; const float* wr = w + r * len;
    for (int64_t d = 0; d < len; d += 32) for (int i = 0; i < 4; ++i) a[i] += load8(wr + d + 8 * i) * load8(x + d + 8 * i);
    out[r] = hsum((a[0] + a[1]) + (a[2] + a[3]));
  }
}
int main(int argc, char** argv) {
  int huge = atoi(argv[1]);
  const int64_t len = 2048, rows_per = 1024; const int64_t nmat = 128;  // 1 GiB f32
  size_t bytes = nmat * rows_per * len * 4;
  float* w = (float*)mmap(nullptr, bytes + (2<<20), PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
  w = (float*)(((uintptr_t)w + (2<<20) - 1) & ~((uintptr_t)(2<<20) - 1));
  if (huge) madvise(w, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < bytes / 4; ++i) w[i] = 0.001f;
  std::vector<float> x(len, 1.0f), out(rows_per * 2);
  for (int threads : {1, 2}) for (int rep = 0; rep < 3; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] {
      for (int64_t m = 0; m < nmat; ++m) {
        const int64_t half = rows_per / threads;
        rows1x4(&w[(m * rows_per + t * half) * len], half, len, x.data(), &out[t * half]);
      }});
    for (auto& th : ts) th.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("huge=%d %d threads %.1f GB/s\n", huge, threads, bytes / s / 1e9);
  }
  FILE* f = fopen("/proc/self/smaps_rollup", "r"); char line[256]; while (fgets(line, 256, f)) if (strstr(line, "AnonHuge")) printf("%s", line);
}
