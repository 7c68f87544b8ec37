// A random 2.65 MB block of a mapped file read by two threads (as a layer reads an expert),
// then copied into a slot (its source now in cache), against a copy of another random
// block (cold). g++ -O2 -pthread hot_copy.cc -o hot_copy && ./hot_copy FILE.gguf
#include <sys/mman.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <random>
#include <cstdlib>
using clk = std::chrono::steady_clock;
int main(int argc, char** argv) {
  size_t block = 2654208;
  int fd = open(argv[1], O_RDONLY); struct stat st; fstat(fd, &st);
  char* src = (char*)mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  size_t nblk = st.st_size / block - 1;
  volatile long sum = 0;
  for (size_t i = 0; i < (size_t)st.st_size; i += 4096) sum += src[i];
  int slots = 32;
  char* dst = (char*)aligned_alloc(64, slots * block);
  memset(dst, 1, slots * block);
  std::mt19937 rng(1);
  auto cp2 = [&](char* d, const char* s) {
    size_t h = block / 2;
    std::thread t([&] { memcpy(d + h, s + h, block - h); });
    memcpy(d, s, h); t.join();
  };
  auto rd2 = [&](const char* s) {   // both threads read their half (as a layer would)
    size_t h = block / 2; volatile long a = 0, b = 0;
    std::thread t([&] { long x = 0; for (size_t i = h; i < block; i += 64) x += s[i]; b = x; });
    long x = 0; for (size_t i = 0; i < h; i += 64) x += s[i]; a = x; t.join();
  };
  for (int rep = 0; rep < 3; ++rep) {
    double cold = 0, hot = 0, read = 0; int n = 200;
    for (int k = 0; k < n; ++k) {
      const char* s = src + (rng() % nblk) * block;
      char* d = dst + (rng() % slots) * block;
      auto t0 = clk::now(); rd2(s); auto t1 = clk::now(); cp2(d, s); auto t2 = clk::now();
      read += std::chrono::duration<double, std::milli>(t1 - t0).count();
      hot += std::chrono::duration<double, std::milli>(t2 - t1).count();
      const char* s2 = src + (rng() % nblk) * block;
      auto t3 = clk::now(); cp2(d, s2); auto t4 = clk::now();
      cold += std::chrono::duration<double, std::milli>(t4 - t3).count();
    }
    printf("read cold %.3f ms, copy after the read %.3f ms, copy cold %.3f ms\n", read / n, hot / n, cold / n);
  }
}
