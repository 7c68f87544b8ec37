"""The top-level Python API, as `moejax.load`, `moejax.OffloadEngine`, `moejax.generate`.

  model = moejax.load("/path/to/model")                  # moejax.Model
  with moejax.OffloadEngine(model, "quality", cache_fraction=0.25) as engine:
    text = moejax.generate(engine, "def fib(n):", max_new_tokens=32)
    engine.stats()                    # this call's hit rate, ms a token (compile excluded), ...
  moejax.generate(model, "def fib(n):")                  # every expert resident

Defaults are moejax-generate's, so the figures of the two compare: the link is the
real copy on an accelerator and, on a CPU-only machine, the scaled emulated link (one
expert's copy costs what it costs on an RTX 3090 relative to a layer's compute); 25%
of each layer's experts resident; greedy decoding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.io.loader import load_model
from moejax.io.store import make_store
from moejax.io.tokenizer import Tokenizer
from moejax.model.config import ModelConfig
from moejax.model.sampler import Sampler, SamplingParams, bucket
from moejax.offload import calibrate, engine, link as link_lib
from moejax.prefetch import speculation
from moejax.prefetch import steps as prefetch_lib


@dataclasses.dataclass(frozen=True)
class Model:
  """A loaded model: its config, dense weights, host expert store and tokenizer."""
  cfg: ModelConfig
  params: dict
  store: object           # moejax.io.store.ExpertStore (or the kind `load` was given)
  tokenizer: Tokenizer
  folder: str
  dtype: jnp.dtype


def load(model_dir: str, *, dtype="float32", store: str = "numpy",
         weights: str = "float") -> Model:
  """The Hugging Face folder `model_dir` (config.json, model.safetensors or its sharded
  index, tokenizer.json) or a GGUF file, its experts in a `store` of kind numpy (RAM), mmap
  (the file, through the page cache) or pinned_host.  weights: moejax-generate's
  --weights: float (the checkpoint's floats in `dtype`) or a ggml block format (q8_0,
  q4_0, q4_k, q6_k: the linears and experts repacked once into the cache folder,
  `moejax.io.weights.quantized`)."""
  dtype = jnp.dtype(dtype)
  cfg, params, experts = load_model(model_dir, dtype=dtype, mmap=store != "numpy",
                                    weights=weights)
  return Model(cfg, params, make_store(experts, store), Tokenizer(model_dir), model_dir,
               dtype)


class OffloadEngine(engine.OffloadEngine):
  """`moejax.offload.engine.OffloadEngine` built from a `Model` with moejax-generate's
  defaults (see the module docstring).

  policy: a preset (quality, speed, baseline) or a miss rule (`moejax.cache.policy`).
  link: None (the default above), "native", "scaled[:PROFILE]", "16GB/s,10us" or a Link.
  prefetch: none, reuse, previous, quasi or hybrid (quasi and hybrid read
  <model_dir>-estimators, or `estimators`: moejax-default-vectors and
  moejax-train-estimators make them).  max_len: the longest prompt + new tokens
  (default: 512 within the model's limit).  Other keywords go to the engine as they are
  (cache_bytes, initial, expert_devices, ...: `EngineConfig`; low_store, counts).
  """

  def __init__(self, model: Model, policy="baseline", *, cache_fraction: float = 0.25,
               link=None, prefetch: str = "none", speculative: str = "off",
               estimators: str | None = None, max_len: int | None = None, **kw):
    spec = link if link is not None else link_lib.default_spec(jax.devices()[0].platform)
    link = calibrate.calibrated_link(spec, model.cfg, model.params, model.store, model.dtype)
    preds = speculation.load_predictors(prefetch, model.cfg, model.folder, estimators)
    pf = prefetch_lib.Prefetch(prefetch, speculative, preds,
                               streaming=bool(kw.pop("streaming", False)))
    if kw.get("cache_bytes"):
      cache_fraction = None
    data = {k: kw.pop(k) for k in ("low_store", "counts") if k in kw}
    config = engine.EngineConfig.make(
        policy, cache_fraction=cache_fraction, link=link,
        max_len=max_len or min(512, model.cfg.max_position_embeddings), dtype=model.dtype,
        prefetch=pf, **kw)
    super().__init__(model.cfg, model.params, model.store, config, **data)
    self.model = model
    self._compiled = None         # the program whose decode step `start_call` compiled

  def start_call(self):
    """Before one `generate` call, as moejax-generate before its one generation: the
    decode step of the current program (policy) compiled, once a program, so that no
    record times a compile; and the earlier calls' records handed over, so that `stats()`
    afterwards describes this call alone."""
    if self._compiled is not self.program:
      self.warmup()
      self._compiled = self.program
    self.take_records()


def generate(target: Model | OffloadEngine, prompt: str, *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> str:
  """The text `target` continues `prompt` with (the prompt not included): an engine of
  `OffloadEngine` under its policy, or a `Model` with every expert resident.  Stops at
  the model's end-of-sequence tokens.  An engine's `stats()` afterwards are this call's
  decode steps, compilation and the prompt pass excluded (`OffloadEngine.start_call`):
  its tpot_ms is moejax-generate's "time per token"."""
  model = target.model if isinstance(target, OffloadEngine) else target
  if not isinstance(model, Model):
    raise TypeError(f"generate() takes a moejax.Model or a moejax.OffloadEngine, not "
                    f"{type(target).__name__}")
  ids = model.tokenizer.encode(prompt)
  if not ids:
    raise ValueError("the prompt encodes to no tokens")
  sp = SamplingParams(temperature, top_p, max_new_tokens, tuple(model.cfg.eos_token_ids))
  need = len(ids) + max_new_tokens
  limit = target.max_len if target is not model else model.cfg.max_position_embeddings
  if need > limit:
    raise ValueError(f"the prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                     f"exceed the context of {limit}; shorten one (or give the engine a "
                     f"larger max_len)")
  if target is model:
    sampler = Sampler(model.cfg, model.params, model.store.device_experts(model.dtype),
                      max_len=min(limit, bucket(need, minimum=64)), dtype=model.dtype)
    out = sampler.generate(ids, sp, seed=seed)
  else:
    target.start_call()
    out = target.generate(ids, sp, seed=seed)
  return model.tokenizer.decode(out)
