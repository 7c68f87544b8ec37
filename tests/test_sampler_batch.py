"""Sequences decoded together, each at its own position (`Sampler.decode_step` with an
end_index per row, `model.put_row`): each row's greedy tokens equal that sequence's alone,
with the CPU kernels and with XLA's ops, for rows that join late and free rows."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.io.loader import init_random
from moejax.io.store import ExpertStore
from moejax.kernels import cpu_kernel
from moejax.model.config import ModelConfig
from moejax.model.model import init_cache, put_row
from moejax.model.sampler import Sampler, SamplingParams

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=97, hidden_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, top_k=2,
                  moe_intermediate_size=32, intermediate_size=128,
                  sparse_layers=(True, True), qk_norm="head").validate()
PROMPTS = ([5, 9, 13], [7, 1, 2, 3, 4, 8, 11], [20], [3, 3, 30, 31, 32])
N_NEW = 6
MAX_LEN = 32


@pytest.fixture(scope="module")
def sampler():
  params, experts = init_random(CFG, seed=3, scale=0.5)
  return Sampler(CFG, params, ExpertStore.from_stacked(experts).to_device(), max_len=MAX_LEN)


def alone(s: Sampler, prompt, n: int) -> list[int]:
  return s.generate(list(prompt), SamplingParams(max_new_tokens=n))


def together(s: Sampler, prompts, joins, n: int, batch: int, fit: bool = False) -> dict:
  """Greedy tokens of each prompt decoded in one batch of `batch` rows; prompt i joins row i
  before step joins[i]; rows without a sequence decode as free rows (fit: each prompt's
  cache sized to its bucket, filling its row's first positions)."""
  sp = SamplingParams()
  cache = init_cache(CFG, batch, MAX_LEN, s.dtype)
  tok, pos = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
  out = {i: [] for i in range(len(prompts))}
  step = 0
  while any(len(v) < n for v in out.values()):
    for i, p in enumerate(prompts):
      if joins[i] == step:
        logits, row = s.prefill(np.asarray([p], np.int32), fit=fit)
        cache = put_row(cache, row, np.int32(i))
        tok[i], pos[i] = int(jnp.argmax(logits[0])), len(p)
        out[i].append(int(tok[i]))
    nxt, _, cache = s.decode_step(cache, tok, pos, sp, jax.random.PRNGKey(0))
    nxt = np.asarray(nxt)
    for i in out:
      if joins[i] <= step and len(out[i]) < n:
        out[i].append(int(nxt[i]))
        tok[i], pos[i] = nxt[i], pos[i] + 1
    step += 1
  return out


@pytest.mark.parametrize("kernel,fit", [(True, False), (False, False), (True, True)])
def test_each_row_decodes_as_its_sequence_alone(sampler, kernel, fit):
  with cpu_kernel.enabled(kernel):
    want = [alone(sampler, p, N_NEW) for p in PROMPTS]
    got = together(sampler, PROMPTS, joins=(0, 0, 2, 3), n=N_NEW, batch=6, fit=fit)
  for i, p in enumerate(PROMPTS):
    assert got[i] == want[i], (i, p)


def test_rows_at_their_own_positions_match_one_position_for_all(sampler):
  """A batch whose rows share one position: the per-row path equals the scalar one."""
  prompts = np.asarray([[5, 9, 13, 2], [7, 1, 2, 3]], np.int32)
  logits, cache = sampler.prefill(prompts)
  tok = np.asarray(jnp.argmax(logits, -1), np.int32)
  sp = SamplingParams()
  _, lg_scalar, _ = sampler.decode_step(jax.tree_util.tree_map(jnp.copy, cache), tok, 4, sp,
                                         jax.random.PRNGKey(0))
  _, lg_rows, _ = sampler.decode_step(cache, tok, np.array([4, 4]), sp, jax.random.PRNGKey(0))
  chex.assert_trees_all_close(lg_rows, lg_scalar, rtol=0, atol=0)


def test_put_row_writes_only_its_row(sampler):
  cache = init_cache(CFG, 3, MAX_LEN, jnp.float32)
  _, row = sampler.prefill(np.asarray([[4, 5, 6]], np.int32))
  out = put_row(jax.tree_util.tree_map(jnp.copy, cache), row, np.int32(1))
  for new, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(row)):
    np.testing.assert_array_equal(np.asarray(new[1]), np.asarray(r[0]))
    assert not np.asarray(new[0]).any() and not np.asarray(new[2]).any()


def test_a_shorter_row_fills_its_first_positions_and_leaves_the_rest(sampler):
  """A prompt cache of its bucket (fit) goes to the row's first positions; the row's later
  positions and the other rows keep what they held (here: ones)."""
  cache = jax.tree_util.tree_map(jnp.ones_like, init_cache(CFG, 3, MAX_LEN, jnp.float32))
  _, row = sampler.prefill(np.asarray([[4, 5, 6]], np.int32), fit=True)
  p = jax.tree_util.tree_leaves(row)[0].shape[1]
  assert p < MAX_LEN
  out = put_row(cache, row, np.int32(2))
  for new, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(row)):
    np.testing.assert_array_equal(np.asarray(new[2, :p]), np.asarray(r[0]))
    assert (np.asarray(new[2, p:]) == 1).all() and (np.asarray(new[:2]) == 1).all()
