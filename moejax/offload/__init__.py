"""Expert offloading: the engine that runs a budgeted device-resident expert cache.

The cache's state and its one policy are in moejax.cache, the speculative
prefetch in moejax.prefetch; this package runs them against a host store.

  decode.py     a decoder layer (the per-layer sequence, written once: emulator, simulator
                and engine) and a token through every layer, on one expert source; the
                engine's jitted programs over it (a step, an on-device loop)
  prompt.py     a prompt through every layer, and the engine's prefill program
  record.py     a step's record packed into one array at the program boundary, unpacked
  sources.py    where a layer reads its experts; the store as the program reads it; errors
  engine.py     OffloadEngine (docs/engine.md)
  config.py     EngineConfig: how an engine runs, validated once (constructor and set_policy)
  stats.py      per-token records, their summary and table
  link.py       the host->device link (native, emulated, scaled), its clock and waits
  hardware.py   the one table of hardware profiles and model shapes (scaled link, time model)
  memory.py     host RAM and device memory a model needs, from its config alone
  calibrate.py  measurements before an engine is built (a scaled link times a layer)
"""
