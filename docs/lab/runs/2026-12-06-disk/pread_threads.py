# pread of random blocks of a file on N threads: python3 pread_threads.py FILE THREADS BLOCK_MB COUNT SEED
# (drop the page cache first, as root: sync; echo 3 > /proc/sys/vm/drop_caches)
import os, sys, time, threading, random
f = sys.argv[1]; nthreads = int(sys.argv[2]); chunk = int(float(sys.argv[3])*2**20); n = int(sys.argv[4])
size = os.path.getsize(f)
fd = os.open(f, os.O_RDONLY)
random.seed(int(sys.argv[5]) if len(sys.argv)>5 else 0)
offs = [random.randrange(0, size-chunk)//4096*4096 for _ in range(n)]
def work(k):
  for i in range(k, n, nthreads):
    os.pread(fd, chunk, offs[i])
t=time.perf_counter()
th=[threading.Thread(target=work,args=(k,)) for k in range(nthreads)]
[x.start() for x in th]; [x.join() for x in th]
dt=time.perf_counter()-t
print(f"threads={nthreads} chunk={chunk/2**20}MB n={n}: {n*chunk/dt/1e9:.2f} GB/s")
