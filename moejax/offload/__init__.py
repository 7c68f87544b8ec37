"""Expert offloading: a budgeted device-resident expert cache and the policies that run it.

  policy.py    the pure, jittable `decide`, eviction order, usage statistics
  resident.py  ResidentState (one layer's cache as a pytree), budget, insert, trim
  layer.py     the per-layer sequence, written once (emulator, simulator and engine)
  token.py     a token or a prompt through every layer, on one expert source
  decode.py    the engine's jitted programs (a step, an on-device loop, a prompt)
  engine.py    OffloadEngine (docs/engine.md)
  prefetch.py  speculative prefetch: predictions, speculative decisions, `Prefetch`
  stats.py     per-token records, their summary and table
  link.py      the host->device link (native, emulated, scaled) and its clock
  transfer.py  the store as the decode program reads it; transfer errors
"""
