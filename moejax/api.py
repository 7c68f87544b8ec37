"""The top-level Python API, as `moejax.load`, `moejax.OffloadEngine`, `moejax.generate`.

  model = moejax.load("/path/to/model")                  # moejax.Model
  with moejax.OffloadEngine.from_model(model, "quality", cache_fraction=0.25) as engine:
    text = moejax.generate(engine, "def fib(n):", max_new_tokens=32)
    engine.stats()                    # this call's hit rate, ms a token (compile excluded), ...
  moejax.generate(model, "def fib(n):")                  # every expert resident

`moejax.OffloadEngine` is `moejax.offload.engine.OffloadEngine`, one class: `from_model`
builds it from a `Model`; its constructor takes (cfg, params, store, EngineConfig), and
`generate` runs an engine built either way (one without a Model given `tokenizer=`).

Defaults are moejax-generate's, so the figures of the two compare: the link is the
real copy on an accelerator and, on a CPU-only machine, the scaled emulated link (one
expert's copy costs what it costs on an RTX 3090 relative to a layer's compute); 25%
of each layer's experts resident; greedy decoding.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from moejax.io.loader import load_model
from moejax.io.store import make_store
from moejax.io.tokenizer import Tokenizer
from moejax.model.config import ModelConfig
from moejax.model.sampler import Sampler, SamplingParams, bucket
from moejax.offload.engine import OffloadEngine


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


def generate(target: Model | OffloadEngine, prompt: str, *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             tokenizer: Tokenizer | None = None) -> str:
  """The text `target` continues `prompt` with (the prompt not included): an
  `OffloadEngine` under its policy, or a `Model` with every expert resident.  Stops at
  the model's end-of-sequence tokens.  tokenizer: the prompt's and the text's (default:
  the Model's, or that of the Model an engine was built from, `OffloadEngine.from_model`).
  An engine's `stats()` afterwards are this call's decode steps, compilation and the
  prompt pass excluded (`OffloadEngine.start_call`): its tpot_ms is moejax-generate's
  "time per token"."""
  if not isinstance(target, (Model, OffloadEngine)):
    raise TypeError(f"generate() takes a moejax.Model or a moejax.OffloadEngine, not "
                    f"{type(target).__name__}")
  engine = target if isinstance(target, OffloadEngine) else None
  model = target if engine is None else engine.model
  tokenizer = tokenizer or (model.tokenizer if model is not None else None)
  if tokenizer is None:
    raise ValueError("this engine was built from (cfg, params, store, config), without a "
                     "moejax.Model: pass tokenizer=moejax.io.tokenizer.Tokenizer(MODEL_DIR), "
                     "or build it with moejax.OffloadEngine.from_model(model, ...)")
  cfg = target.cfg
  ids = tokenizer.encode(prompt)
  if not ids:
    raise ValueError("the prompt encodes to no tokens")
  sp = SamplingParams(temperature, top_p, max_new_tokens, tuple(cfg.eos_token_ids))
  need = len(ids) + max_new_tokens
  limit = engine.max_len if engine is not None else cfg.max_position_embeddings
  if need > limit:
    raise ValueError(f"the prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                     f"exceed the context of {limit}; shorten one (or give the engine a "
                     f"larger max_len)")
  if engine is None:
    sampler = Sampler(cfg, model.params, model.store.device_experts(model.dtype),
                      max_len=min(limit, bucket(need, minimum=64)), dtype=model.dtype)
    out = sampler.generate(ids, sp, seed=seed)
  else:
    engine.start_call()
    out = engine.generate(ids, sp, seed=seed)
  return tokenizer.decode(out)
