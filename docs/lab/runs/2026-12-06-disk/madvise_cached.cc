// The cost of madvise(MADV_WILLNEED) over 9.4 MB blocks of a file already in the page cache.
// g++ -O2 madvise_cached.cc -o m && ./m FILE   (FILE >= 302 MB)
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
int main(int argc, char** argv) {
  int fd = open(argv[1], O_RDONLY); size_t blk = 768*2048*2*3, n = 32;
  char* a = (char*)mmap(0, blk*n, PROT_READ, MAP_SHARED, fd, 0);
  volatile long s = 0; for (size_t i = 0; i < blk*n; i += 4096) s += a[i];   // cached now
  for (int r = 0; r < 3; ++r) {
    auto t = std::chrono::steady_clock::now();
    for (size_t e = 0; e < n; ++e) madvise(a + blk*e, blk, MADV_WILLNEED);
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
    printf("%zu calls on cached 9.4 MB blocks: %.1f us (%.2f us/call)\n", n, us, us/n);
  }
}
