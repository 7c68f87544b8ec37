"""Expert offloading: a budgeted device-resident expert cache and the policies that run it.

  policy.py        the pure, jittable `decide` (miss rules, substitution, admission),
                   eviction order and usage statistics; DecideParams / CacheParams
  resident.py      ResidentState (the cache pytree), budget, donated insertion, trim
  steps.py         the engine's jitted per-layer steps and host<->device packings
  admissions.py    the background-admission queue (an immutable value)
  inserts.py       writing fetched and admitted experts into the slot buffers
  stats.py         per-token records, their summary and table
  calibrate.py     explicit measurements: layer compute time, scaled link, profile counts
  link.py          the host->device link (native, emulated, scaled) and its schedule
  tickets.py       one transfer (Ticket) and the waits on tickets
  transfer.py      the prefetch thread (`jax.device_put`, deduplication, cancellation)
  copies.py        owned host stacks and device copies of experts
  host_store.py    ExpertStore back-ends (numpy, memory-mapped safetensors, pinned_host)
  host_experts.py  the `host` policy's numpy expert path
  engine.py        OffloadEngine: prefill and decode under a budget (its docstring lists
                   the public surface; docs/engine.md describes the parts)
  timeline.py      decode-step traces cut into segments
"""
