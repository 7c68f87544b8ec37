"""The engine's fused calls (a MoE layer's experts and the next layer's decision in one
call, `steps.fused_steps`; run_layers=False) give bit-identical outputs and records to
separate calls."""

import dataclasses

import numpy as np
import pytest

from moejax.loader import load_model
from moejax.offload import link as link_lib
from moejax.offload import policy as P
from moejax.offload import steps as steps_lib
from moejax.offload.engine import OffloadEngine
from moejax.offload.stats import COUNT_KEYS
from tests import hf_models

PROMPT = [3, 17, 5, 60, 22, 9]
STREAM = [int(t) for t in np.random.default_rng(5).integers(0, 64, 12)]


def _run(cfg, params, store, policy, fuse, **kw):
  with OffloadEngine(cfg, params, store, policy, max_len=32, fuse_layers=fuse, run_layers=False,
                     **kw) as eng:
    eng.warmup()
    eng.trace = True
    out = [eng.prefill(PROMPT)] + [eng.decode_step(t) for t in STREAM]
  return eng, np.stack(out)


def _layers(rec):
  return {l: {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
          for l, r in rec.layers.items()}


QUALITY = P.make_policy("quality", admission_beta=0.05)
CASES = [   # (family, model overrides, policy, engine kwargs)
    ("qwen3_moe", {}, "baseline", dict(cache_fraction=0.25)),
    ("qwen3_moe", {}, QUALITY, dict(cache_fraction=0.25, link="20MB/s")),
    ("qwen3_moe", {}, "speed", dict(cache_fraction=0.125)),     # 1 slot < top-k: staging, trim
    ("qwen3_moe", {}, "host", dict(cache_fraction=0.5)),
    ("qwen3_next", {}, QUALITY, dict(cache_fraction=0.25)),     # DeltaNet + full attention
    ("qwen3_next", {}, "speed", dict(cache_fraction=0.125)),
    ("glm4_moe", dict(num_hidden_layers=3), QUALITY, dict(cache_fraction=0.25)),  # dense first
]
_BUILT = {}


def _model(family, over, tmp_path_factory):
  """Each family's tiny random model with every layer after the first MoE, built once."""
  key = (family, tuple(sorted(over.items())))
  if key not in _BUILT:
    kw = dict(over) if family == "glm4_moe" else dict(over, mlp_only_layers=[])
    d = hf_models.save(hf_models.build(family, **kw),
                       str(tmp_path_factory.mktemp(family)), "per_expert")
    _BUILT[key] = load_model(d)
  return _BUILT[key]


@pytest.mark.parametrize("family,over,policy,kw", CASES,
                         ids=[f"{c[0]}-{c[2] if isinstance(c[2], str) else 'quality'}-{i}"
                              for i, c in enumerate(CASES)])
def test_fused_calls_equal_separate_calls(family, over, policy, kw, tmp_path_factory):
  cfg, params, store = _model(family, over, tmp_path_factory)
  if "link" in kw:
    kw = dict(kw, link=link_lib.parse_link(kw["link"], expert_bytes=store.expert_nbytes()))
  pairs = [i for i in cfg.moe_layers if steps_lib.fusable(cfg, i)]
  assert pairs, "the model must have consecutive MoE layers"
  sep, out_sep = _run(cfg, params, store, policy, False, **kw)
  fus, out_fus = _run(cfg, params, store, policy, True, **kw)
  np.testing.assert_array_equal(out_fus, out_sep)
  for a, b in zip(fus.records, sep.records):
    assert {k: a[k] for k in COUNT_KEYS} == {k: b[k] for k in COUNT_KEYS}
    assert _layers(a) == _layers(b)
  assert fus.resident_sets() == sep.resident_sets()
  if policy is QUALITY and family == "qwen3_moe":   # admissions inserted in the fused call
    assert sum(r["admitted"] for r in fus.records) > 0
  # the timeline still has every layer's marks, in order; a fused layer's moe call
  # is marked at the start of the next layer's call
  for tr in fus.traces:
    times = [t for _, _, t in tr]
    assert times == sorted(times)
    evs = [(ev, l) for ev, l, _ in tr]
    for l in cfg.moe_layers:
      mine = [ev for ev, ll in evs if ll == l]
      assert mine[:2] == ["attend", "decided"] and mine[-2:] == ["moe", "moe_done"]
    for i in pairs:
      assert evs.index(("moe_done", i)) < evs.index(("attend", i + 1))


def test_fused_steps_compile_once_per_pair_of_kinds(tmp_path_factory):
  cfg, params, store = _model("qwen3_moe", {}, tmp_path_factory)
  with OffloadEngine(cfg, params, store, QUALITY, cache_fraction=0.25, max_len=32,
                     run_layers=False) as eng:
    eng.warmup()
    fs = steps_lib.fused_steps(cfg, eng.dtype, 0, eng.policy.decision, eng.policy.cache,
                               None)
    assert fs is steps_lib.fused_steps(cfg, eng.dtype, 1, eng.policy.decision,
                                       eng.policy.cache, None)
    before = {n: f._cache_size() for n, f in fs._asdict().items()}
    eng.prefill(PROMPT)
    for t in STREAM:
      eng.decode_step(t)
    assert {n: f._cache_size() for n, f in fs._asdict().items()} == before
    assert before["moe_attend_decide"] == 1
    assert sum(r["admitted"] for r in eng.records) > 0    # the insert variant ran
