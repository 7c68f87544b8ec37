"""The simulator's batch (`simulate(batch=B)`): B streams of a trace decoded in lockstep,
one per-layer step per batch of tokens sharing the layer's cache."""

import numpy as np
import pytest

from moejax.research import simulator as sim
from moejax.research import synthetic, timemodel
from moejax.cache import policy as P
from moejax.offload import hardware


def _trace(tokens=160, experts=16, top_k=4, layers=2, seed=0):
  cfg = synthetic.shape_config(experts, top_k, layers)
  rng = np.random.default_rng(seed)
  pop = np.sort(rng.dirichlet(np.ones(experts), size=layers), axis=1)[:, ::-1]
  bias = synthetic.popularity_bias(pop, experts, layers, rng)
  return cfg, synthetic.generate(tokens, bias, synthetic.GenParams(), seed=seed + 1)


@pytest.mark.parametrize("name", ["baseline", "first_choice", "substitute_all"])
def test_copies_of_a_stream_fetch_once(name):
  """B identical streams (no admission: the accumulator would add up B times): every step
  is B copies of one token, so the caches evolve as one stream's (LFU counts scale by B,
  which keeps their order); fetches and distinct experts executed per step are one
  stream's per token; the other copies hit what the first fetched."""
  cfg, lg = _trace()
  nb, prompt = 3, 8
  name = P.make_policy(name, eviction="lfu" if name != "baseline" else None)
  one, = sim.simulate(cfg, lg, [name], cache_fraction=0.25, prefill_tokens=prompt)
  rep, = sim.simulate(cfg, np.concatenate([lg] * nb), [name], cache_fraction=0.25,
                      prefill_tokens=prompt, batch=nb)
  assert rep.tokens == nb * one.tokens and rep.batch == nb
  np.testing.assert_array_equal(rep.steps_TxLxC, one.steps_TxLxC)
  for f in ("fetches", "evictions", "fetches_low"):
    np.testing.assert_array_equal(rep.per_layer(f), one.per_layer(f), err_msg=f)
  for f in ("expert_calls", "substituted", "dropped"):
    np.testing.assert_array_equal(rep.per_layer(f), nb * one.per_layer(f), err_msg=f)
  np.testing.assert_array_equal(rep.per_layer("hits"), nb * one.per_layer("hits")
                                + (nb - 1) * one.per_layer("fetches"))
  s1, sb = one.summary(), rep.summary()
  assert sb["fetches_per_token"] == pytest.approx(s1["fetches_per_token"] / nb)
  assert sb["fetches_per_step"] == pytest.approx(s1["fetches_per_step"])
  # the same steps take the same time: per token, a B-th
  tp = timemodel.roofline(hardware.hardware("rtx3090"), hardware.model_shape("qwen3-30b-a3b"))
  np.testing.assert_array_equal(timemodel.time_per_token(rep.steps_TxLxC, tp),
                                timemodel.time_per_token(one.steps_TxLxC, tp))


def test_streams_are_consecutive_cuts_and_share_the_cache():
  """B = 2 on a trace of two different halves: 2 x (100 - 4) decoded tokens in 96 steps,
  decisions per (step, layer, token), every selection a call, calls = hits + misses, and
  per step between 1 and 2 K distinct experts executed."""
  cfg, lg = _trace(tokens=200, seed=3)
  r, = sim.simulate(cfg, lg, ["quality"], cache_fraction=0.25, prefill_tokens=4, batch=2,
                    detail=True)
  assert r.tokens == 2 * (100 - 4) and r.steps_TxLxC.shape == (96, 2, len(sim.STEP_FIELDS))
  assert r.detail["action"].shape == (96, 2, 2, cfg.top_k)
  assert r.total("expert_calls") == r.tokens * 2 * cfg.top_k
  assert r.total("hits") + r.total("misses") == r.total("expert_calls")
  dev = r.steps_TxLxC[..., sim.STEP_FIELDS.index("device_calls")]
  assert dev.max() <= 2 * cfg.top_k and dev.min() >= 1     # first choices always run


def test_batch_errors_name_the_argument():
  cfg, lg = _trace(tokens=40)
  with pytest.raises(ValueError, match="batch=0"):
    sim.simulate(cfg, lg, ["baseline"], batch=0)
  with pytest.raises(ValueError, match="4 streams"):
    sim.simulate(cfg, lg, ["baseline"], batch=4, prefill_tokens=10)


def test_cli_batch_usage_error_comes_before_loading(tmp_path):
  import os
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "launch.simulate", f"--trace={tmp_path}/none",
                      f"--out={tmp_path}/out", "--batch=2,0"], cwd=repo, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  assert "--batch" in r.stderr and "trace.json" not in r.stderr, r.stderr[-2000:]
