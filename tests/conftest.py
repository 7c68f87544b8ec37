import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# --store=mmap repacks experts into a cache folder (moejax.io.repack): a fresh one per
# test process, so no test reads what another run wrote, and nothing lands in ~/.cache
if "MOEJAX_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile
  _cache = tempfile.mkdtemp(prefix="moejax_test_cache_")
  os.environ["MOEJAX_CACHE_DIR"] = _cache
  atexit.register(shutil.rmtree, _cache, True)
