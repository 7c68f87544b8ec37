"""A scanned engine's stacked slot buffers are held once while they are built
(`cache.initial.engine_states`): stacking filled per-layer buffers had held every
resident expert twice (4 real-width layers, all resident: 8.75 GB peak against a 5.24 GB
plan).  Measured in a child process, as the growth of its peak resident set (VmHWM)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, types
    import jax, numpy as np
    from moejax.cache import initial, policy, resident

    L, E, K, D, I = 4, 32, 4, 512, 1024          # 6 MB an expert, 768 MB of slots
    host = {"gate_up": np.ones((L, E, 2 * I, D), np.float32),
            "down": np.ones((L, E, D, I), np.float32)}
    store = types.SimpleNamespace(get=lambda l, e: {k: v[l, e] for k, v in host.items()})
    cfg = types.SimpleNamespace(num_experts=E, top_k=K)
    budget = resident.make_budget(E, K, 6 << 20, L, fraction=1.0)
    build = lambda layers: initial.engine_states(
        store, cfg, layers, budget, "all", policy.CacheParams(), 0, jax.devices()[0],
        stacked=True)
    jax.block_until_ready(build([0]))            # compiles; then the peak is reset
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    open("/proc/self/clear_refs", "w").write("5")
    before = hwm()
    states = jax.block_until_ready(build(list(range(L))))
    slots = sum(b.nbytes for b in states.buffers.values())
    print(json.dumps({"growth": hwm() - before, "slots": slots}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_stacked_slot_buffers_are_never_held_twice():
  out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  # once: the slots plus a block of 8 rows in flight (48 MB) and the runtime's noise;
  # twice would be 2x the slots
  assert got["growth"] < 1.3 * got["slots"], got
