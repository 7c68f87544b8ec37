// 5 MB blocks copied from a memory-mapped file (page cache warm) into an anonymous buffer:
// memcpy or non-temporal stores, one thread or two. g++ -O2 -mavx512f -pthread copy_probe.cc
#include <immintrin.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <random>
using clk = std::chrono::steady_clock;
static void nt_copy(char* d, const char* s, size_t n) {
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64),
            c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
    _mm512_stream_si512((__m512i*)(d + i), a); _mm512_stream_si512((__m512i*)(d + i + 64), b);
    _mm512_stream_si512((__m512i*)(d + i + 128), c); _mm512_stream_si512((__m512i*)(d + i + 192), e);
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();
}
int main(int argc, char** argv) {
  const char* path = argv[1];
  size_t block = 5 << 20;
  int fd = open(path, O_RDONLY); struct stat st; fstat(fd, &st);
  size_t sz = st.st_size;
  char* src = (char*)mmap(nullptr, sz, PROT_READ, MAP_SHARED, fd, 0);
  size_t nblk = sz / block - 1;
  volatile long sum = 0;
  for (size_t i = 0; i < sz; i += 4096) sum += src[i];   // map every page
  int slots = 32;
  char* dst = (char*)aligned_alloc(64, slots * block);
  memset(dst, 1, slots * block);
  std::mt19937 rng(1);
  for (int mode = 0; mode < 4; ++mode) {
    for (int rep = 0; rep < 2; ++rep) {
      int n = 200;
      auto t0 = clk::now();
      for (int k = 0; k < n; ++k) {
        const char* s = src + (rng() % nblk) * block;
        char* d = dst + (rng() % slots) * block;
        if (mode == 0) memcpy(d, s, block);
        else if (mode == 1) nt_copy(d, s, block);
        else {
          size_t h = block / 2;
          std::thread t([&] { mode == 2 ? (void)memcpy(d + h, s + h, block - h) : nt_copy(d + h, s + h, block - h); });
          mode == 2 ? (void)memcpy(d, s, h) : nt_copy(d, s, h);
          t.join();
        }
      }
      double ms = std::chrono::duration<double, std::milli>(clk::now() - t0).count() / n;
      printf("mode %d (%s): %.3f ms a 5 MB block, %.1f GB/s\n", mode,
             mode == 0 ? "memcpy 1t" : mode == 1 ? "nt 1t" : mode == 2 ? "memcpy 2t" : "nt 2t",
             ms, block / ms / 1e6);
    }
  }
}
