"""The `host` miss policy's compute path: missed experts run on the host CPU in numpy.

This is how llama.cpp (CPU expert tensors) and Fiddler serve experts that are not
on the accelerator: the activations travel to the host instead of the weights
travelling to the device.  It is a separate code path with its own measured
cost (the engine reports its time as `host_s`).
"""

from __future__ import annotations

import time

import numpy as np

from moejax import families


class HostComputeError(ValueError):
  """The host path cannot compute this family's experts."""


def check_supported(expert: dict, family: str):
  layout = families.for_experts(expert)
  if not layout.is_expert_dict(expert) or (layout.expert_ffn is not None
                                           and layout.expert_forward_np is None):
    raise HostComputeError(
        f"--policy=host: the host expert path computes SiLU-gated experts "
        f"{{gate_up, down}}; {family} experts have {sorted(expert)}")


def _silu(x):
  return x / (1.0 + np.exp(-x))


def expert_forward(x_D: np.ndarray, w: dict) -> np.ndarray:
  """One SiLU-gated expert, f32: down @ (silu(gate) * up), gate_up = [gate; up] rows."""
  forward = families.for_experts(w).expert_forward_np
  if forward is not None:  # the family's own layout (gpt_oss: clamped SwiGLU, MXFP4)
    return forward(x_D, w)
  gu = np.asarray(w["gate_up"], np.float32)
  h = gu @ x_D.astype(np.float32)
  g, u = np.split(h, 2)
  return np.asarray(w["down"], np.float32) @ (_silu(g) * u)


def host_moe(x_D: np.ndarray, ids, weights, get_expert) -> np.ndarray:
  """sum_j weights[j] * expert_{ids[j]}(x) on the host; get_expert(e) -> {name: array}."""
  y = np.zeros(x_D.shape[-1], np.float32)
  for e, g in zip(ids, weights):
    y += np.float32(g) * expert_forward(x_D, get_expert(int(e)))
  return y


def layer_out(x, moe_in, ids, weights, get_expert, rec):
  """The HOST experts' share of a layer's output, shaped and typed like x (the
  decision's ids and gate weights of its HOST actions); the time goes to rec.host_s."""
  t0 = time.perf_counter()
  y = host_moe(np.asarray(moe_in).reshape(-1), ids, weights, get_expert)
  rec.host_s += time.perf_counter() - t0
  return y.reshape(x.shape).astype(x.dtype)
