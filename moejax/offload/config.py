"""How an OffloadEngine runs: `EngineConfig`, one validated object (its policy, budget,
link, cache length, dtype, initial contents, prefetch, timeout and devices), and
`check_policy`, what a policy needs of the engine, shared by its constructor and
`set_policy`.

  config = EngineConfig.make("quality", cache_fraction=0.25, link="16GB/s,10us")
  OffloadEngine(cfg, params, store, config)
  EngineConfig.for_model(model, "quality")      # moejax-generate's defaults for a moejax.Model
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.cache import policy as policy_lib
from moejax.io import staging
from moejax.offload import calibrate, expert_parallel
from moejax.offload import link as link_lib
from moejax.prefetch import speculation
from moejax.prefetch.steps import Mode, Prefetch


INITIAL = ("auto", "empty", "all", "profile")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How an OffloadEngine runs: objects only, checked when made (`make` takes the CLI's
  strings).  policy: the miss rule, admission and eviction.  cache_fraction or
  cache_bytes: the expert budget (`resident.make_budget`).  link: the host->device link
  (a scaled link comes from `calibrate.calibrated_link`).  initial: the slots' contents
  at the start (auto, empty, all, or profile: the engine's `counts`).  prefetch:
  speculative prefetch (`streaming` keeps no expert across tokens).  expert_devices > 1:
  every MoE layer's slots over that many devices, the budget per device.
  host_cache_bytes: with an mmap store, the host staging tier's bytes (`io.staging`;
  None: the program reads the whole store, mapped or pinned)."""
  policy: policy_lib.PolicyParams = dataclasses.field(
      default_factory=lambda: policy_lib.make_policy("baseline"))
  cache_fraction: float | None = 0.25
  cache_bytes: int | None = None
  link: link_lib.Link = link_lib.NATIVE
  max_len: int = 512
  dtype: str = "float32"
  initial: str = "auto"
  prefetch: Prefetch = Prefetch()
  transfer_timeout_s: float = 120.0
  expert_devices: int = 1
  layer_scan: bool = True     # False: the layers unrolled (`decode.Program.scan`)
  host_cache_bytes: int | None = None

  def __post_init__(self):
    def need(ok, msg):
      if not ok:
        raise ValueError(msg)
    need(isinstance(self.policy, policy_lib.PolicyParams), f"policy={self.policy!r}: a "
         "PolicyParams (EngineConfig.make takes a preset or miss-rule name)")
    need(isinstance(self.link, link_lib.Link), f"link={self.link!r}: a Link (EngineConfig."
         "make takes a spec; a scaled link comes from calibrate.calibrated_link)")
    need(isinstance(self.prefetch, Prefetch), f"prefetch={self.prefetch!r}: a Prefetch")
    Mode(self.prefetch.kind, self.prefetch.speculative)    # --prefetch / --speculative
    need(self.initial in INITIAL, f"initial={self.initial!r}: one of {', '.join(INITIAL)}")
    need(self.max_len >= 2, f"max_len={self.max_len}: at least 2 (a prompt token and one more)")
    need(self.transfer_timeout_s > 0, f"transfer_timeout_s={self.transfer_timeout_s}: > 0")
    need(int(self.expert_devices) >= 1, f"expert_devices={self.expert_devices}: >= 1")
    jnp.dtype(self.dtype)     # an unknown name raises here
    if self.host_cache_bytes is not None and (self.expert_devices > 1 or
                                              self.policy.decision.host):
      other = "--policy=host" if self.policy.decision.host else "--expert_devices > 1"
      raise staging.StagingError(f"--host_cache_gb with {other}: host experts and expert-"
                                 f"parallel replicas read the whole store in place; drop "
                                 f"--host_cache_gb")
    if self.expert_devices > 1 and self.prefetch.kind != "none":
      raise expert_parallel.ExpertParallelError(
          f"--expert_devices={self.expert_devices} with --prefetch={self.prefetch.kind}: "
          f"speculative prefetch is not expert-parallel yet (its prefetch rows live on one "
          f"device)")

  @classmethod
  def make(cls, policy: policy_lib.PolicyParams | str = "baseline", *,
           link: link_lib.Link | str = "native", **kw) -> "EngineConfig":
    """The config from a preset or miss-rule name and a link spec ("native",
    "16GB/s,10us"), as the command line gives them; other fields as they are."""
    if isinstance(policy, str):
      policy = policy_lib.make_policy(policy)
    if isinstance(link, str):
      if link.strip().lower().startswith("scaled"):
        raise link_lib.LinkSpecError(
            f"link={link!r}: a scaled link needs this machine's layer compute time; build "
            f"it with moejax.offload.calibrate.calibrated_link(spec, cfg, params, store, "
            f"dtype) and pass the Link")
      link = link_lib.parse_link(link)
    if "dtype" in kw:
      kw["dtype"] = jnp.dtype(kw["dtype"]).name
    if "host_cache_gb" in kw:       # the CLI's --host_cache_gb (None: off)
      kw["host_cache_bytes"] = staging.size_bytes(kw.pop("host_cache_gb"))
    return cls(policy=policy, link=link, **kw)

  @classmethod
  def for_model(cls, model, policy: policy_lib.PolicyParams | str = "baseline", *,
                cache_fraction: float | None = 0.25, link=None, prefetch: str = "none",
                speculative: str = "off", estimators: str | None = None,
                max_len: int | None = None, streaming: bool = False, **kw) -> "EngineConfig":
    """The config of a loaded `moejax.Model` with moejax-generate's defaults: the link
    None is the real copy on an accelerator and, on a CPU-only machine, the scaled
    emulated link ("native", "scaled[:PROFILE]", "16GB/s,10us" or a Link: a scaled one
    calibrated on `model`); 25% of each layer's experts resident (cache_bytes, when given,
    instead); prefetch none, reuse, previous, quasi or hybrid (quasi and hybrid read
    <model_dir>-estimators, or `estimators`: moejax-default-vectors and
    moejax-train-estimators make them); max_len the longest prompt + new tokens (default:
    512 within the model's limit).  Other keywords are fields as they are."""
    spec = link if link is not None else link_lib.default_spec(jax.devices()[0].platform)
    link = calibrate.calibrated_link(spec, model.cfg, model.params, model.store, model.dtype)
    preds = speculation.load_predictors(prefetch, model.cfg, model.folder, estimators)
    if kw.get("cache_bytes"):
      cache_fraction = None
    return cls.make(policy, cache_fraction=cache_fraction, link=link,
                    max_len=max_len or min(512, model.cfg.max_position_embeddings),
                    dtype=model.dtype, prefetch=Prefetch(prefetch, speculative, preds,
                                                         streaming=bool(streaming)), **kw)


def check_policy(policy: policy_lib.PolicyParams, platform: str, low_store,
                 staged: bool = False) -> None:
  """What a policy needs of the engine that runs it (its constructor and `set_policy`;
  staged: the engine reads its experts through a host staging tier)."""
  if staged and policy.decision.host:
    raise policy_lib.PolicyError("--policy=host computes misses from the store where it "
                                 "lives: not with --host_cache_gb")
  if policy.decision.host and platform != "cpu":
    raise policy_lib.PolicyError(
        "--policy=host computes misses on the host CPU, inside the decode program where "
        "the store lives: that needs the CPU backend (on an accelerator, use the "
        "simulator's host time model)")
  if low_store is not None and low_store.bits != policy.decision.low_bits:
    raise policy_lib.PolicyError(f"--low_bits={policy.decision.low_bits}: the low-precision "
                                 f"store holds int{low_store.bits} copies")
