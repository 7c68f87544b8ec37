"""The model core: a frozen config per checkpoint family, the Flax layers, routing, the expert computation and the resident-model sampler."""
