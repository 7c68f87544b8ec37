// Blocks of a Q4_0 expert's size (2.65 MB) copied from random places of a memory-mapped
// file (page cache warm, larger than the L3) into 32 anonymous slots, two threads: memcpy,
// non-temporal stores, a copy with software prefetch 2 KB ahead, the same 4 KB at a time.
// (The printed "5 MB" is the 2026-12-07 probe's label; the block is 2,654,208 bytes.)
//   g++ -O2 -mavx512f -pthread copy_probe2.cc -o copy_probe2 && ./copy_probe2 FILE.gguf
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
static void pf_copy(char* d, const char* s, size_t n) {
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    _mm_prefetch(s + i + 2048, _MM_HINT_T0); _mm_prefetch(s + i + 2048 + 64, _MM_HINT_T0);
    _mm_prefetch(s + i + 2048 + 128, _MM_HINT_T0); _mm_prefetch(s + i + 2048 + 192, _MM_HINT_T0);
    __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64),
            c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
    _mm512_storeu_si512((__m512i*)(d + i), a); _mm512_storeu_si512((__m512i*)(d + i + 64), b);
    _mm512_storeu_si512((__m512i*)(d + i + 128), c); _mm512_storeu_si512((__m512i*)(d + i + 192), e);
  }
  std::memcpy(d + i, s + i, n - i);
}
int main(int argc, char** argv) {
  const char* path = argv[1];
  size_t block = 2654208;
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
  for (int mode = 2; mode < 6; ++mode) {
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
          auto f = [&](char* dd, const char* ss, size_t nn) { if (mode == 2) memcpy(dd, ss, nn); else if (mode == 3) nt_copy(dd, ss, nn); else if (mode == 4) pf_copy(dd, ss, nn); else { for (size_t o = 0; o < nn; o += 4096) { size_t m = std::min<size_t>(4096, nn - o); pf_copy(dd + o, ss + o, m);} } };
          std::thread t([&] { f(d + h, s + h, block - h); });
          f(d, s, h);
          t.join();
        }
      }
      double ms = std::chrono::duration<double, std::milli>(clk::now() - t0).count() / n;
      printf("mode %d (%s): %.3f ms a 5 MB block, %.1f GB/s\n", mode,
             mode == 0 ? "memcpy 1t" : mode == 1 ? "nt 1t" : mode == 2 ? "memcpy 2t" : mode == 3 ? "nt 2t" : "pf 2t",
             ms, block / ms / 1e6);
    }
  }
}
