// The cost of cpu_pages.h will_need over cached 9.4 MB blocks (the mincore probe skips the hint),
// in a mapping whose pages are mapped and in one whose are not. g++ -O2 -std=c++17 probe_cost.cc -o p && ./p FILE
#include "../../../../moejax/kernels/cpu_pages.h"
#include <fcntl.h>
#include <chrono>
#include <cstdio>
#include <initializer_list>
int main(int argc, char** argv) {
  int fd = open(argv[1], O_RDONLY); size_t blk = 768*2048*2*3, n = 32;
  char* a = (char*)mmap(0, blk*n, PROT_READ, MAP_SHARED, fd, 0);
  char* b = (char*)mmap(0, blk*n, PROT_READ, MAP_SHARED, fd, 0);
  volatile long s = 0; for (size_t i = 0; i < blk*n; i += 4096) s += a[i];
  for (char* m : {a, b}) for (int r = 0; r < 2; ++r) {
    auto t = std::chrono::steady_clock::now();
    for (size_t e = 0; e < n; ++e) moejax::will_need(m + blk*e, blk);
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
    printf("%s: %.2f us/block\n", m == a ? "cached, mapped" : "cached, not mapped here", us/n);
  }
}
