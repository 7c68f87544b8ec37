"""Expert offloading: a budgeted device-resident expert cache and the policies that run it.

  policy.py        the pure, jittable `decide` (miss rules, substitution, admission),
                   eviction choice and usage statistics; presets quality/speed/baseline
  resident.py      ResidentState (the cache pytree), budget accounting, donated insertion
  link.py          the host->device link: native, emulated, or scaled to a GPU profile
  transfer.py      the prefetch thread (`jax.device_put`, tickets, cancellation)
  host_store.py    ExpertStore back-ends (numpy, memory-mapped safetensors, pinned_host)
  host_experts.py  the `host` policy's numpy expert path
  engine.py        OffloadEngine: prefill and decode under a budget, per-token statistics
"""
