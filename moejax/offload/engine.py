"""OffloadEngine: real decoding with a budgeted device-resident expert cache.

Per MoE layer and decoded token:
  (a) one jitted call: `DecoderLayer.attend` + `route_logits` + `policy.decide`
      (preceded, in the same call, by inserting the layer's arrived background
      admissions); the host reads the decision (one small transfer);
  host: copies the FETCH experts at once on this thread (`Prefetcher.fetch`: one
      stacked copy, the link time committed; a hand-off to the prefetch thread
      would only add its wake-up) and queues the layer's new admissions for the
      prefetch thread.  While the fetches' link time elapses it inserts them
      into slots (`resident.insert`, jitted, state donated:
      `lax.dynamic_update_slice`, never evicting an expert the token uses; the
      rows are not computed with before the link time ends, as a DMA engine
      writes straight into the slot), counts statistics and inserts arrived
      admissions of other layers while one fits; then waits for the link, and
      computes HOST experts in numpy;
  (b) one jitted call, state donated: `DecoderLayer.moe_residual` from slot
      indices, then the usage-statistics update.
Dense layers run whole.  Jitted functions are built per layer *kind* (sparse or
dense, and the family's layer type), so compile count does not grow with depth.

Background admissions requested at token t for layer l are inserted before
layer l of token t+1 (the engine waits there if the transfer has not arrived
and counts that as `admission_wait_s`), or earlier, in another layer's spare
link time once they have arrived: the same insert in the same order, since no
use of layer l's state comes in between.  So results do not depend on thread
timing; `admission_timing="on_arrival"` inserts them whenever they are done.

Prefill is exact for every policy: per layer, the union of the prompt's
selected experts is made available (missing ones fetched synchronously, in one
batch), then the fetched experts the prompt used most are inserted into free or
evictable slots (never evicting an expert the prompt used).

Batch size 1.  Times are wall-clock seconds on this machine; every printed time
names the link (`Link.describe()`).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax import routing
from moejax.config import ModelConfig
from moejax.model import DecoderLayer, Transformer, init_cache
from moejax.offload import host_experts
from moejax.offload import policy as policy_lib
from moejax.offload import resident as resident_lib
from moejax.offload import transfer as transfer_lib
from moejax.offload.policy import DROP, FETCH, HIT, HOST, SUBSTITUTE, PolicyParams
from moejax.sampler import SamplingParams, bucket, sample_token

STAT_KEYS = ("expert_calls", "hits", "misses", "fetches", "fetch_bytes", "substituted",
             "substituted_mass", "dropped", "dropped_mass", "host_calls", "admissions",
             "admitted", "evictions", "wait_s", "admission_wait_s", "host_s", "compute_s",
             "wall_s")


def _layer_kind(cfg: ModelConfig, i: int):
  lt = getattr(cfg, "layer_types", ()) or ()
  return (bool(cfg.sparse_layers[i]), lt[i] if lt else "")


# ------------------------------------------------------------------ jitted steps
def _module(cfg: ModelConfig, dtype, layer_idx: int):
  sparse = cfg.sparse_layers[layer_idx]
  return (DecoderLayer(cfg, sparse, dtype, layer_idx) if _has_layer_idx()
          else DecoderLayer(cfg, sparse, dtype))


def _attend_route(mdl, x, pos, cache, end):
  h, cache = mdl.attend(x, pos, cache, end)
  moe_in, logits = mdl.route_logits(h)
  return h, moe_in, logits, cache


def _steps(cfg: ModelConfig, dtype, layer_idx: int, policy: PolicyParams):
  """The jitted functions of one layer kind; cached across engines, and keyed only
  on the policy fields each function reads (so policies share compiles)."""
  out = dict(_base_steps(cfg, dtype, layer_idx))
  out.update(_policy_steps(cfg, dtype, layer_idx, policy.decision, policy.cache))
  return out


def _unpack_tp(tp):
  """The decode step's one small host input [token, position] -> (positions [1,1], end)."""
  return tp[1].reshape(1, 1), tp[1]


@functools.lru_cache(maxsize=None)
def _policy_steps(cfg: ModelConfig, dtype, layer_idx: int, decide_key: policy_lib.DecideParams,
                  cache_key: policy_lib.CacheParams):
  mod = _module(cfg, dtype, layer_idx)
  usage_key = evict_key = cache_key
  num_e = cfg.num_experts

  def _attend_decide(p, x, tp, cache, state):
    pos, end = _unpack_tp(tp)
    h, moe_in, logits, cache = mod.apply({"params": p}, x, pos, cache, end, method=_attend_route)
    dec = policy_lib.decide(logits.reshape(-1, logits.shape[-1]), state, decide_key, cfg)
    # what the host reads, in one transfer: action, ids, exec_ids, weights, gates (K each)
    # and the admission mask (E); small ints are exact in f32
    f = lambda a: a.reshape(-1).astype(jnp.float32)
    host = jnp.concatenate([f(dec.action[0]), f(dec.ids[0]), f(dec.exec_ids[0]),
                            f(dec.weights[0]), f(dec.gates[0]), f(dec.admit)])
    return h, moe_in, cache, dec, host

  attend_decide = jax.jit(_attend_decide, donate_argnums=(3,))

  def _insert_rows(state, ins, rows):
    """ins = [R expert ids (-1: none) | E in-use mask], rows [R, ...] (R: a row bucket)."""
    r = ins.shape[0] - num_e
    return resident_lib.insert(state, ins[:r], rows, ins[r:] > 0, evict_key)

  @functools.partial(jax.jit, donate_argnums=(3, 4))
  def insert_attend_decide(p, x, tp, cache, state, ins, rows):
    """Inserts arrived background admissions, then attend_decide: one dispatch."""
    state, evicted = _insert_rows(state, ins, rows)
    return _attend_decide(p, x, tp, cache, state) + (state, evicted)

  def _moe(p, h, moe_in, dec, host_out, state):
    e = dec.exec_ids
    slot = state.expert_slot[jnp.maximum(e, 0)]
    w = jnp.where(e >= 0, dec.weights, 0.0)
    b, t = h.shape[:2]
    y = mod.apply({"params": p}, h, moe_in, slot.reshape(b, t, -1), w.reshape(b, t, -1),
                  state.buffers, method="moe_residual")
    return y + host_out.astype(y.dtype), policy_lib.update_usage(state, dec, usage_key)

  moe = jax.jit(_moe, donate_argnums=(5,))

  return dict(attend_decide=attend_decide, insert_attend_decide=insert_attend_decide, moe=moe)


@functools.lru_cache(maxsize=None)
def _base_steps(cfg: ModelConfig, dtype, layer_idx: int):
  mod = _module(cfg, dtype, layer_idx)
  attend_route = _attend_route

  def _dense(mdl, x, pos, cache, end):
    h, cache = mdl.attend(x, pos, cache, end)
    return mdl.dense_residual(h), cache

  @functools.partial(jax.jit, donate_argnums=(3,))
  def dense(p, x, pos, cache, end):
    return mod.apply({"params": p}, x, pos, cache, end, method=_dense)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def dense_decode(p, x, tp, cache):
    pos, end = _unpack_tp(tp)
    return mod.apply({"params": p}, x, pos, cache, end, method=_dense)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def prefill_attend(p, x, pos, cache, end):
    h, moe_in, logits, cache = mod.apply({"params": p}, x, pos, cache, end, method=attend_route)
    ids, gates, _ = routing.route(cfg, logits.reshape(-1, logits.shape[-1]))
    return h, moe_in, cache, ids, gates

  @jax.jit
  def prefill_moe(p, h, moe_in, idx, gates, buffers, extra):
    table = {k: jnp.concatenate([buffers[k], extra[k]]) for k in buffers}
    b, t = h.shape[:2]
    return mod.apply({"params": p}, h, moe_in, idx.reshape(b, t, -1), gates.reshape(b, t, -1),
                     table, method="moe_residual")

  return dict(dense=dense, dense_decode=dense_decode, prefill_attend=prefill_attend,
              prefill_moe=prefill_moe)


@functools.lru_cache(maxsize=None)
def _has_layer_idx() -> bool:
  return "layer_idx" in {f.name for f in dataclasses.fields(DecoderLayer)}


@functools.partial(jax.jit, static_argnames=("decay",), donate_argnums=(0,))
def _prefill_usage(state, counts_E, decay: float):
  used = counts_E > 0
  return dataclasses.replace(state, last_used=jnp.where(used, state.step, state.last_used),
                             freq=state.freq * decay + counts_E, step=state.step + 1)


@functools.lru_cache(maxsize=None)
def _model_steps(cfg: ModelConfig, dtype):
  model = Transformer(cfg, dtype)
  embed = jax.jit(lambda p, t: model.apply({"params": p}, t, method="embed"))
  # the decode step's one host input [token, position] goes in as numpy (a jit argument
  # is cheaper than a device_put here) and comes back as a device array for the layers
  embed_decode = jax.jit(lambda p, tp: (model.apply({"params": p}, tp[:1].reshape(1, 1),
                                                    method="embed"), tp))
  head = jax.jit(lambda p, x: model.apply({"params": p}, x, method="logits"))
  head_decode = jax.jit(lambda p, x: model.apply({"params": p}, x[:, -1], method="logits")[0])
  return embed, head, embed_decode, head_decode


# ------------------------------------------------------------------ statistics
def summarize(records: list[dict], cfg: ModelConfig) -> dict:
  """Means per token over decode records, plus rates (see README for definitions)."""
  n = len(records)
  if n == 0:
    return {"tokens": 0}
  tot = {k: float(sum(r[k] for r in records)) for k in STAT_KEYS}
  calls = max(tot["expert_calls"], 1.0)
  moe_layers = max(1, len(cfg.moe_layers))
  s = {"tokens": n}
  s.update({f"{k}_per_token": tot[k] / n for k in STAT_KEYS if not k.endswith("_s")})
  s.update({f"{k[:-2]}_ms_per_token": 1e3 * tot[k] / n for k in STAT_KEYS if k.endswith("_s")})
  s["tpot_ms"] = 1e3 * tot["wall_s"] / n
  s["tpot_median_ms"] = 1e3 * float(np.median([r["wall_s"] for r in records]))
  s["hit_rate"] = tot["hits"] / calls
  s["substituted_call_pct"] = 100.0 * tot["substituted"] / calls
  s["substituted_mass_per_token_layer"] = tot["substituted_mass"] / (n * moe_layers)
  s["substituted_mass_per_token"] = tot["substituted_mass"] / n
  return s


def format_stats(s: dict, link_desc: str) -> str:
  if not s.get("tokens"):
    return "no decoded tokens"
  rows = [
      ("tokens decoded", f"{s['tokens']}"),
      ("time per token", f"{s['tpot_ms']:.2f} ms  (link: {link_desc})"),
      ("  waiting for fetches", f"{s['wait_ms_per_token']:.2f} ms"),
      ("  waiting for admissions", f"{s['admission_wait_ms_per_token']:.2f} ms"),
      ("  host expert compute", f"{s['host_ms_per_token']:.2f} ms"),
      ("  compute (rest)", f"{s['compute_ms_per_token']:.2f} ms"),
      ("expert calls / token", f"{s['expert_calls_per_token']:.1f}"),
      ("hit rate", f"{100 * s['hit_rate']:.1f} %"),
      ("misses / token", f"{s['misses_per_token']:.2f}"),
      ("sync fetches / token", f"{s['fetches_per_token']:.2f} "
                               f"({s['fetch_bytes_per_token'] / 2**20:.3f} MiB)"),
      ("substituted calls", f"{s['substituted_call_pct']:.1f} % of expert calls"),
      ("substituted mass", f"{s['substituted_mass_per_token_layer']:.4f} per token-layer, "
                           f"{s['substituted_mass_per_token']:.4f} per token"),
      ("dropped / host calls per token", f"{s['dropped_per_token']:.2f} / "
                                         f"{s['host_calls_per_token']:.2f}"),
      ("admissions / evictions per token", f"{s['admissions_per_token']:.2f} / "
                                           f"{s['evictions_per_token']:.2f}"),
  ]
  w = max(len(a) for a, _ in rows)
  return "\n".join(f"{a.ljust(w)}  {b}" for a, b in rows)


def profile_counts(cfg: ModelConfig, params, store, tokens, dtype=jnp.float32) -> dict:
  """Per MoE layer, how often the fully resident model routes each expert on `tokens`:
  the input of ``initial="profile"`` (the most frequently routed experts start resident)."""
  model = Transformer(cfg, dtype)
  _, _, router = jax.jit(lambda p, e, t: model.apply({"params": p}, t, e))(
      params, store.to_device(dtype), jnp.asarray([list(tokens)], jnp.int32))
  out = {}
  for l in cfg.moe_layers:
    ids, _, _ = routing.route(cfg, router[l].reshape(-1, router[l].shape[-1]))
    out[l] = np.bincount(np.asarray(ids).reshape(-1), minlength=cfg.num_experts)
  return out


def layer_compute_seconds(cfg: ModelConfig, params, store, dtype=jnp.float32,
                          steps: int = 20) -> float:
  """One layer's decode compute time on this machine, all experts resident.

  25th-percentile time of a fully resident jitted decode step divided by the layer count:
  the denominator of the scaled link's ratio.
  """
  from moejax.sampler import Sampler
  s = Sampler(cfg, params, store.to_device(dtype), max_len=64, dtype=dtype)
  _, cache = s.prefill(np.zeros((1, 4), np.int32))
  tok = jnp.zeros((1,), jnp.int32)
  sp, key = SamplingParams(), jax.random.PRNGKey(0)
  times = []
  for i in range(steps + 3):
    t0 = time.perf_counter()
    tok, lg, cache = s.decode_step(cache, tok, 4 + i, sp, key)
    lg.block_until_ready()
    times.append(time.perf_counter() - t0)
  # a low percentile: on a shared machine the slow steps measure the other processes
  return float(np.percentile(times[3:], 25)) / cfg.num_layers


def resolve_link(spec, cfg: ModelConfig, params, store, dtype=jnp.float32):
  """A Link object from a Link or a --link spec (the scaled link measures compute here)."""
  from moejax.offload import link as link_lib
  if not isinstance(spec, str):
    return spec
  if spec.strip().startswith("scaled"):
    return link_lib.parse_link(spec, expert_bytes=store.expert_nbytes(),
                               layer_compute_s=layer_compute_seconds(cfg, params, store, dtype))
  return link_lib.parse_link(spec, expert_bytes=store.expert_nbytes())


# ------------------------------------------------------------------ engine
class OffloadEngine:
  """Decoding under an expert budget with a policy, real transfers on a prefetch thread."""

  def __init__(self, cfg: ModelConfig, params, store, policy: PolicyParams | str = "baseline", *,
               cache_fraction: float | None = 0.25, cache_bytes: int | None = None,
               link: Any = "native", max_len: int = 512, dtype=jnp.float32,
               initial: Any = "auto", profile_counts: dict | None = None,
               admission_timing: str = "next_token", verbose: bool = False):
    if isinstance(policy, str):
      policy = policy_lib.make_policy(policy)
    if admission_timing not in ("next_token", "on_arrival"):
      raise ValueError(f"admission_timing must be 'next_token' or 'on_arrival', "
                       f"got {admission_timing!r}")
    # Every array the jitted steps see is committed to one device, so a step compiles
    # once (uncommitted and committed arguments would compile separately).
    self.device = jax.devices()[0]
    self._put = functools.partial(jax.device_put, device=self.device)
    self.cfg, self.params, self.store, self.policy = cfg, self._put(params), store, policy
    self.dtype, self.max_len = dtype, max_len
    self.admission_timing = admission_timing
    self.moe_layers = tuple(cfg.moe_layers)
    self.budget = resident_lib.make_budget(
        cfg.num_experts, cfg.top_k, store.expert_nbytes(), len(self.moe_layers),
        fraction=cache_fraction, nbytes=cache_bytes)
    if policy.miss == "host":
      host_experts.check_supported(store.get(self.moe_layers[0], 0), cfg.model_type)
    self.link = resolve_link(link, cfg, params, store, dtype)
    self._embed, self._head, self._embed_decode, self._head_decode = _model_steps(cfg, dtype)
    rep = {}
    for i in range(cfg.num_layers):
      rep.setdefault(_layer_kind(cfg, i), i)
    self._kind_steps = {k: _steps(cfg, dtype, i, policy) for k, i in rep.items()}
    self._layer_steps = [self._kind_steps[_layer_kind(cfg, i)] for i in range(cfg.num_layers)]

    first = store.get(self.moe_layers[0], 0)
    self._zero_rows = self._put({k: np.zeros((cfg.top_k,) + np.shape(v), np.asarray(v).dtype)
                                 for k, v in first.items()})
    spec = {k: (np.shape(v), jnp.dtype(np.asarray(v).dtype)) for k, v in first.items()}
    self.states = {l: self._put(resident_lib.init_state(cfg.num_experts, self.budget.physical,
                                                        spec))
                   for l in self.moe_layers}
    self._evict_key = policy.cache   # what insert reads
    self._zero_x = np.zeros((1, 1, cfg.hidden_size), jnp.dtype(dtype))   # host expert output
    self._fill_initial(initial, profile_counts)
    # on the CPU backend, device memory is host memory: transfers copy into private
    # host stacks that the jitted inserts take as arguments (see Prefetcher.host_copies)
    self._host_rows = (self.device.platform == "cpu"
                       and all(isinstance(v, np.ndarray) for v in first.values()))
    # the decode thread spins (yielding) through its waits for link time: after a sleep
    # its next device call runs measurably slower (the idle vCPU's wake-up, cold caches)
    self.prefetcher = transfer_lib.Prefetcher(store, self.link, host_copies=self._host_rows,
                                              wait_spin_s=float("inf"))
    self.prefetcher.__enter__()
    self._pending: dict[int, list] = {l: [] for l in self.moe_layers}
    self.cache = None
    self.end_index = 0
    self.records: list[dict] = []
    self.prefill_record: dict | None = None
    self._row_buckets = tuple(sorted({min(2, cfg.top_k), cfg.top_k}))
    # early admission inserts run under a fetch's link time only while one fits in
    # what is left of it; an insert's cost: measured by warmup(), updated as they run
    self._insert_s = float("inf")
    # trace=True: each decode step appends its timeline to self.traces (see decode_step)
    self.trace = False
    self.traces: list[list[tuple[str, int, float]]] = []
    if verbose:
      print(f"[moejax] {self.describe()}", file=sys.stderr)

  # -------------------------------------------------------------- setup
  def _fill_initial(self, initial, profile_counts):
    if initial == "auto":
      initial = "all" if self.budget.all_resident else "empty"
    if initial == "empty":
      return
    for l in self.moe_layers:
      if initial == "all":
        order = range(self.cfg.num_experts)
      elif initial == "profile":
        if profile_counts is None or l not in profile_counts:
          raise ValueError(f"initial='profile' needs profile_counts for MoE layer {l}")
        order = resident_lib.profile_order(profile_counts[l])[: self.budget.slots]
      else:
        raise ValueError(f"initial must be 'auto', 'empty', 'all' or 'profile', got {initial!r}")
      self.states[l] = resident_lib.fill(self.states[l], order,
                                         functools.partial(self.store.get, l), self._evict_key,
                                         chunk=self.cfg.top_k)

  def describe(self) -> str:
    return (f"policy {self.policy.describe()}; {self.budget.describe()}; "
            f"link {self.link.describe()}")

  def accounting(self) -> dict:
    d = self.budget.as_dict()
    d["resident_per_layer"] = {l: int(np.sum(np.asarray(s.slot_expert) >= 0))
                               for l, s in self.states.items()}
    return d

  def close(self):
    for l in self.moe_layers:
      for tk in self._pending[l]:
        tk.cancel()
      self._pending[l] = []
    self.prefetcher.close()

  def __enter__(self):
    return self

  def __exit__(self, exc_type, exc, tb):
    if exc_type is None:
      self.close()
      return
    try:  # do not mask the exception already propagating (e.g. a TransferError)
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass

  # -------------------------------------------------------------- helpers
  def _insert(self, l: int, ids: list[int], rows: dict, in_use_E: np.ndarray, rec: dict):
    """Inserts experts ids (stacked rows [>= len(ids), ...]) K at a time into layer l's
    cache; counts evictions.  (Prefill and admission overflow; decode fuses its inserts.)"""
    k = self.cfg.top_k
    for i in range(0, len(ids), k):
      part = ids[i:i + k]
      jid = np.asarray(list(part) + [-1] * (k - len(part)), np.int32)
      r = {n: v[i:i + k] for n, v in rows.items()}
      if len(part) < k:
        r = {n: jnp.concatenate([v, self._zero_rows[n][:k - v.shape[0]]]) for n, v in r.items()}
      # small host inputs go in as numpy: a jit argument costs less than a device_put
      self.states[l], ev = resident_lib.insert_jit(self.states[l], jid, r, in_use_E,
                                                   self._evict_key)
      rec.setdefault("_evicted", []).append(ev)
      in_use_E = in_use_E.copy()
      in_use_E[list(part)] = True

  def _take_admissions(self, l: int, rec: dict):
    """The arrived background admissions of layer l as (ins [K + E] int32, rows) for the
    fused insert before layer l's attend_decide, or None.  Beyond K of them (possible
    with on_arrival timing), the first ones are inserted here in chunks of K."""
    pend = self._pending[l]
    if not pend:
      return None
    if self.admission_timing == "on_arrival":
      done = [t.done() for t in pend]
      ready = [t for t, d in zip(pend, done) if d]
      self._pending[l] = [t for t, d in zip(pend, done) if not d]
    else:
      ready, self._pending[l] = pend, []
    # a ticket that a synchronous fetch took over (same expert, upgraded to "sync")
    # was already inserted by that fetch
    ready = [t for t in ready if t.priority == "background"]
    if not ready:
      return None
    t0 = time.perf_counter()
    for t in ready[::-1]:
      t._block()  # pylint: disable=protected-access  (arrival; the rows stay stacked)
    rec["admission_wait_s"] += time.perf_counter() - t0
    ids = [t.key[1] for t in ready]
    rec["admitted"] += len(ids)
    k, num_e = self.cfg.top_k, self.cfg.num_experts
    split = (len(ids) - 1) // k * k
    in_use = np.zeros(num_e, bool)
    if split:
      self._insert(l, ids[:split], transfer_lib.stacked(ready[:split]), in_use, rec)
      in_use[ids[:split]] = True                       # do not evict them for the rest
    ids, ready = ids[split:], ready[split:]
    ins, r = self._ins(ids, in_use)
    return ins, transfer_lib.stacked(ready, r)

  def _rows(self, n: int) -> int:
    """The row bucket for inserting n <= K experts: 2 or K (one compile each; most
    groups are 1-2 experts, and a smaller insert writes fewer rows)."""
    return min(b for b in self._row_buckets if b >= n)

  def _ins(self, ids, in_use_E) -> tuple[np.ndarray, int]:
    """([R ids, -1 padded | E in-use mask] int32, R) for a fused insert of `ids`."""
    r = self._rows(len(ids))
    ins = np.zeros(r + self.cfg.num_experts, np.int32)
    ins[:r] = -1
    ins[:len(ids)] = ids
    ins[r:] = in_use_E
    return ins, r

  def _insert_rows(self, state, ins, rows):
    """resident.insert of [R ids | E in-use mask] `ins` and rows [>= R, ...] (jitted)."""
    r = ins.shape[0] - self.cfg.num_experts
    return resident_lib.insert_jit(state, ins[:r], rows, ins[r:] > 0, self._evict_key)

  def _admit_arrived(self, after: int, rec: dict, deadline: float):
    """Inserts, while a fetch of layer `after` crosses the link (until `deadline`), the
    admissions of other layers whose every pending transfer has arrived (later layers
    first, then the earlier ones, whose admissions of this token arrived), as long as
    one insert (its cost measured as inserts run) still fits before the deadline.  Each
    would be inserted before its layer's next decision anyway, and no use of that
    layer's state comes in between: same inserts, same order, same results."""
    order = [l for l in self.moe_layers if l > after] + [l for l in self.moe_layers if l < after]
    for l in order:
      if time.perf_counter() + self._insert_s > deadline:
        return
      if self._pending[l] and all(t.done() for t in self._pending[l]):
        t0 = time.perf_counter()
        adm = self._take_admissions(l, rec)
        if adm is not None:
          self.states[l], ev = self._insert_rows(self.states[l], *adm)
          rec.setdefault("_evicted", []).append(ev)
          self._insert_s = 0.5 * self._insert_s + 0.5 * (time.perf_counter() - t0)

  @staticmethod
  def _count(rec: dict, action, gates, fetches: int):
    """Adds one layer's decision (K actions and gate weights) to the token's statistics.
    Plain Python over K values: ~10 us, against ~55 us for the same in small numpy ops."""
    act, g = action.tolist(), gates.tolist()
    # masses are normalised shares g / sum(selected g): for routers whose gates do
    # not sum to 1 (sigmoid, OLMoE) this is the quantity the threshold rule compares
    total = max(sum(g), 1e-20)
    rec["expert_calls"] += len(act)
    hits = act.count(HIT)
    rec["hits"] += hits
    rec["misses"] += len(act) - hits
    rec["fetches"] += fetches
    rec["substituted"] += act.count(SUBSTITUTE)
    rec["substituted_mass"] += sum(w for a, w in zip(act, g) if a == SUBSTITUTE) / total
    rec["dropped"] += act.count(DROP)
    rec["dropped_mass"] += sum(w for a, w in zip(act, g) if a == DROP) / total
    rec["host_calls"] += act.count(HOST)

  def _new_record(self) -> dict:
    return {k: 0.0 for k in STAT_KEYS}

  def _finish_record(self, rec: dict, t0: float) -> dict:
    ev = rec.pop("_evicted", [])
    rec["evictions"] = float(sum(int(np.sum(np.asarray(e) >= 0)) for e in ev))
    rec["wall_s"] = time.perf_counter() - t0
    rec["compute_s"] = rec["wall_s"] - rec["wait_s"] - rec["admission_wait_s"] - rec["host_s"]
    return rec

  def warmup(self):
    """Compiles every decode-path step once on throwaway inputs (state untouched), so
    that per-token statistics measure decoding, not compilation."""
    cfg, kk = self.cfg, self.cfg.top_k
    x, tp = self._embed_decode(self.params, np.zeros(2, np.int32))
    jax.block_until_ready(self._head_decode(self.params, x))
    # the prefetch thread's device copies: 1..K experts padded to their row bucket
    zero = {k: np.zeros(np.shape(v), np.asarray(v).dtype)
            for k, v in self.store.get(self.moe_layers[0], 0).items()}
    if not self._host_rows:
      for n in range(1, kk + 1):
        jax.block_until_ready(transfer_lib.stacked_device_put(
            [zero] * n, self.prefetcher.sharding, self._rows(n)))
    done = set()
    for i, st in enumerate(self._layer_steps):
      kind = _layer_kind(cfg, i)
      if kind in done:
        continue
      done.add(kind)
      p = self.params[f"layers_{i}"]
      cache = self._put(init_cache(cfg, 1, self.max_len, self.dtype)[i])
      if not cfg.sparse_layers[i]:
        jax.block_until_ready(st["dense_decode"](p, x, tp, cache))
        continue
      copy = lambda: jax.tree_util.tree_map(jnp.copy, self.states[i])
      h, moe_in, _, dec, _ = st["attend_decide"](p, x, tp, cache, copy())
      jax.block_until_ready(st["moe"](p, h, moe_in, dec, self._zero_x, copy()))
      for r in self._row_buckets:
        ins = np.concatenate([np.full(r, -1, np.int32), np.zeros(cfg.num_experts, np.int32)])
        zero_rows = {k: v[:r] for k, v in self._zero_rows.items()}
        # rows come as host stacks (host copies) or device arrays (gathered across groups)
        for rows in ([zero_rows, jax.device_get(zero_rows)] if self._host_rows else [zero_rows]):
          cache = self._put(init_cache(cfg, 1, self.max_len, self.dtype)[i])   # donated
          jax.block_until_ready(st["insert_attend_decide"](p, x, tp, cache, copy(), ins, rows))
          jax.block_until_ready(self._insert_rows(copy(), ins, rows))
        times = []
        for _ in range(5):
          c = copy()
          t0 = time.perf_counter()
          jax.block_until_ready(self._insert_rows(c, ins, zero_rows))
          times.append(time.perf_counter() - t0)
        # a first estimate; _admit_arrived updates it with the inserts' real cost
        self._insert_s = min(self._insert_s, float(np.median(times[1:])))

  # -------------------------------------------------------------- prefill
  def prefill(self, prompt_ids) -> np.ndarray:
    """Runs the prompt (exact for every policy); returns the last position's logits [V]."""
    from moejax.families.qwen3_next import has_recurrent_state
    t0 = time.perf_counter()
    rec = self._new_record()
    t = len(prompt_ids)
    if t < 1:
      raise ValueError("prefill needs at least one prompt token")
    if t + 1 > self.max_len:
      raise ValueError(f"prompt of {t} tokens does not fit max_len={self.max_len}")
    tb = t if has_recurrent_state(self.cfg) else min(bucket(t), self.max_len)
    toks = np.zeros((1, tb), np.int32)
    toks[0, :t] = prompt_ids
    self.cache = self._put(init_cache(self.cfg, 1, self.max_len, self.dtype))
    pos = self._put(np.arange(tb, dtype=np.int32)[None])
    end = self._put(np.int32(0))
    x = self._embed(self.params, self._put(toks))
    num_e = self.cfg.num_experts
    for i, st in enumerate(self._layer_steps):
      p = self.params[f"layers_{i}"]
      if not self.cfg.sparse_layers[i]:
        x, self.cache[i] = st["dense"](p, x, pos, self.cache[i], end)
        continue
      state = self.states[i]
      h, moe_in, self.cache[i], ids, gates = st["prefill_attend"](p, x, pos, self.cache[i], end)
      ids_np = np.asarray(ids)
      valid = ids_np[:t]
      counts = np.bincount(valid.reshape(-1), minlength=num_e).astype(np.float32)
      used = np.flatnonzero(counts)
      exp_slot = np.asarray(state.expert_slot)
      missing = [int(e) for e in used if exp_slot[e] < 0]
      missing.sort(key=lambda e: (-counts[e], e))
      fb = bucket(max(1, len(missing)), minimum=self.cfg.top_k)
      extra = self._zero_rows
      if missing:
        tickets, _ = self.prefetcher.fetch(i, missing, pad_to=fb)
        tw = time.perf_counter()
        extra = transfer_lib.wait_stacked(tickets, fb)
        rec["wait_s"] += time.perf_counter() - tw
        rec["fetch_bytes"] += sum(tk.nbytes for tk in tickets)
      rec["fetches"] += len(missing)
      hits = int(np.sum(exp_slot[valid.reshape(-1)] >= 0))
      rec["expert_calls"] += valid.size
      rec["hits"] += hits
      rec["misses"] += valid.size - hits
      idx_map = exp_slot.copy()
      for j, e in enumerate(missing):
        idx_map[e] = self.budget.physical + 1 + j          # after the slots and scratch row
      pad_ids = np.where(np.arange(tb)[:, None] < t, ids_np, ids_np[:1])   # padding: token 0's
      x = st["prefill_moe"](p, h, moe_in, self._put(idx_map[pad_ids].astype(np.int32)), gates,
                            state.buffers, extra)
      in_use = np.zeros(num_e, bool)
      in_use[used] = exp_slot[used] >= 0               # never evict an expert the prompt hit
      if missing:
        self._insert(i, missing, extra, in_use, rec)
      self.states[i] = _prefill_usage(self.states[i], self._put(counts),
                                      float(self.policy.lfu_decay) ** t)
    logits = self._head(self.params, x[:, t - 1])
    out = np.asarray(logits[0])
    self.end_index = t
    self.prefill_record = self._finish_record(rec, t0)
    self.prefill_record["tokens"] = t
    return out

  # -------------------------------------------------------------- decode
  def decode_step(self, token: int) -> np.ndarray:
    """Feeds one token at position `end_index`; returns the next-token logits [V]."""
    if self.cache is None:
      raise ValueError("decode_step before prefill")
    if self.end_index >= self.max_len:
      raise ValueError(f"max_len={self.max_len} reached")
    t0 = time.perf_counter()
    rec = self._new_record()
    # with self.trace: (event, layer, perf_counter) marks of this step's timeline --
    # "attend" (before the layer's attend/decide call), "decided" (after it), "fetch"
    # (before the fetch is asked for), "arrived" (its link wait over), "moe", "moe_done",
    # "dense", "head", "end"; the step starts at t0
    tr = [("start", -1, t0)] if self.trace else None
    mark = ((lambda ev, l: tr.append((ev, l, time.perf_counter()))) if tr is not None
            else (lambda ev, l: None))
    x, tp = self._embed_decode(self.params, np.asarray([token, self.end_index], np.int32))
    num_e, kk = self.cfg.num_experts, self.cfg.top_k
    for i, st in enumerate(self._layer_steps):
      p = self.params[f"layers_{i}"]
      if not self.cfg.sparse_layers[i]:
        mark("dense", i)
        x, self.cache[i] = st["dense_decode"](p, x, tp, self.cache[i])
        continue
      mark("attend", i)
      adm = self._take_admissions(i, rec)
      if adm is None:
        h, moe_in, self.cache[i], dec, packed = st["attend_decide"](p, x, tp, self.cache[i],
                                                                    self.states[i])
      else:     # insert the arrived admissions, then attend and decide, in one call
        h, moe_in, self.cache[i], dec, packed, self.states[i], ev = st["insert_attend_decide"](
            p, x, tp, self.cache[i], self.states[i], *adm)
        rec.setdefault("_evicted", []).append(ev)
      packed = np.asarray(packed)
      mark("decided", i)
      action, ids, exec_ids = (packed[j * kk:(j + 1) * kk].astype(np.int32) for j in range(3))
      weights, gates = packed[3 * kk:4 * kk], packed[4 * kk:5 * kk]
      admit = packed[5 * kk:] > 0
      fetch = [int(e) for e in ids[action == FETCH]]
      host_mask = action == HOST
      if fetch:
        mark("fetch", i)
        # copied on this thread at once, the link time committed (see Prefetcher.fetch)
        tickets, rows = self.prefetcher.fetch(i, fetch, pad_to=self._rows(len(fetch)))
        in_use = np.zeros(num_e, bool)
        in_use[exec_ids[exec_ids >= 0]] = True     # never evicted for a fetched expert
        ins, r = self._ins(fetch, in_use)
      if admit.any():            # queued behind the sync fetches: they never delay them
        adm_ids = [int(e) for e in np.flatnonzero(admit)]
        self._pending[i].extend(self.prefetcher.request_many(
            i, adm_ids, "background", pad_to=self._rows(min(len(adm_ids), kk))))
        rec["admissions"] += len(adm_ids)
      self._count(rec, action, gates, len(fetch))
      if fetch:
        # while the link time elapses: the rows go into their slots, then arrived
        # admissions of other layers are inserted as long as one fits in what is left
        if rows is not None:
          self.states[i], ev = self._insert_rows(self.states[i], ins, rows)
          rec.setdefault("_evicted", []).append(ev)
          self._admit_arrived(after=i, rec=rec, deadline=max(t.finished_s for t in tickets))
        tw = time.perf_counter()
        arrived = transfer_lib.wait_stacked(tickets, r)
        rec["wait_s"] += time.perf_counter() - tw
        mark("arrived", i)
        rec["fetch_bytes"] += sum(tk.nbytes for tk in tickets)
        if rows is None:         # some came from a background transfer: insert them now
          self.states[i], ev = self._insert_rows(self.states[i], ins, arrived)
          rec.setdefault("_evicted", []).append(ev)
      host_out = self._zero_x
      if host_mask.any():
        th = time.perf_counter()
        y = host_experts.host_moe(np.asarray(moe_in).reshape(-1), ids[host_mask],
                                  weights[host_mask], functools.partial(self.store.get, i))
        host_out = y.reshape(x.shape).astype(x.dtype)
        rec["host_s"] += time.perf_counter() - th
      mark("moe", i)
      x, self.states[i] = st["moe"](p, h, moe_in, dec, host_out, self.states[i])
      if tr is not None:
        jax.block_until_ready(x)
      mark("moe_done", i)
    mark("head", -1)
    out = np.asarray(self._head_decode(self.params, x))
    self.end_index += 1
    self.records.append(self._finish_record(rec, t0))
    if tr is not None:
      tr.append(("end", -1, t0 + self.records[-1]["wall_s"]))
      self.traces.append(tr)
    return out

  def generate(self, prompt_ids, sp: SamplingParams, seed: int = 0, on_token=None) -> list[int]:
    """Prefill + up to sp.max_new_tokens sampled tokens (batch 1)."""
    t = len(prompt_ids)
    if t + sp.max_new_tokens > self.max_len:
      raise ValueError(f"prompt ({t}) + max_new_tokens ({sp.max_new_tokens}) exceeds "
                       f"max_len={self.max_len}")
    key = jax.random.PRNGKey(seed)
    logits = self.prefill(prompt_ids)
    out = []
    for i in range(sp.max_new_tokens):
      key, sub = jax.random.split(key)
      tid = int(sample_token(jnp.asarray(logits)[None], sub, float(sp.temperature),
                             float(sp.top_p))[0])
      out.append(tid)
      if on_token:
        on_token(tid)
      if tid in sp.stop_ids or i == sp.max_new_tokens - 1:
        break
      logits = self.decode_step(tid)
    return out

  def stats(self, skip: int = 0) -> dict:
    """Summary of the decode records after the first `skip` tokens (warm-up)."""
    return summarize(self.records[skip:], self.cfg)

  def resident_sets(self) -> dict[int, list[int]]:
    return {l: s.resident_experts() for l, s in self.states.items()}
