# Reads 9.4 MB blocks at random offsets of a file through a mapping: by page faults alone
# ("fault") or after madvise(MADV_WILLNEED) over each block ("willneed"), `group` blocks
# asked for before touching them. Drop the page cache first (as root):
#   sync; echo 3 > /proc/sys/vm/drop_caches; python3 faults.py FILE willneed 48 8
import mmap, os, sys, time, random
import numpy as np
f = sys.argv[1]; mode = sys.argv[2]; chunk = int(9.4*2**20); n = int(sys.argv[3]); group=int(sys.argv[4])
size = os.path.getsize(f)
fd = os.open(f, os.O_RDONLY)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
a = np.frombuffer(m, dtype=np.uint8)
random.seed(1)
offs = [random.randrange(0, size-chunk)//4096*4096 for _ in range(n)]
t=time.perf_counter()
s=0
for g in range(0, n, group):
  batch = offs[g:g+group]
  if mode == "willneed":
    for o in batch: m.madvise(mmap.MADV_WILLNEED, o, chunk)
  for o in batch:
    s += int(a[o:o+chunk:4096].sum())
dt=time.perf_counter()-t
print(f"{mode} group={group}: {n*chunk/dt/1e9:.2f} GB/s")
