// The cost of madvise(MADV_WILLNEED) over 9.4 MB blocks in anonymous memory.
// g++ -O2 madvise_anon.cc -o m && ./m
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdlib>
int main() {
  size_t blk = 768*2048*2, E = 128;
  char* a = (char*)aligned_alloc(4096, 3*blk*E); memset(a, 1, 3*blk*E);
  for (int r = 0; r < 3; ++r) {
    auto t = std::chrono::steady_clock::now();
    for (size_t e = 0; e < E; ++e) { madvise(a + 3*blk*e, 2*blk, MADV_WILLNEED); madvise(a + 3*blk*e + 2*blk, blk, MADV_WILLNEED); }
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
    printf("%zu calls: %.1f us (%.2f us/call)\n", 2*E, us, us/(2*E));
  }
}
