"""Routing locality: plain LRU / LFU expert caches on hand-written selection sequences."""

import chex
import numpy as np
import pytest

from benchmarks import locality


def test_lru_hand_checked():
  # one layer, E = 4, k = 1, capacity 2: A B A C B -> miss miss hit miss(evict B) miss(evict A)
  ids = np.array([0, 1, 0, 2, 1])[:, None, None]
  np.testing.assert_allclose(locality.cache_hit_rate(ids, 4, 2, "lru"), [1 / 5])


def test_lfu_keeps_the_frequent_expert():
  # A A B C A: LFU evicts B for C (A selected twice) and then hits A; LRU would too here,
  # but A B B C A differs: LRU evicts A for C (A older), LFU (A 1, B 2) also evicts A.
  ids = np.array([0, 0, 1, 2, 0])[:, None, None]
  np.testing.assert_allclose(locality.cache_hit_rate(ids, 4, 2, "lfu"), [2 / 5])
  ids2 = np.array([0, 0, 0, 1, 2, 1, 2, 0])[:, None, None]
  # LRU: A hit hit, B miss, C miss (evict A), B hit, C hit, A miss -> 4 hits of 8
  np.testing.assert_allclose(locality.cache_hit_rate(ids2, 4, 2, "lru"), [4 / 8])
  # LFU: C evicts B (freq A=3 > B=1); then B misses, evicting C (1 < 3); C misses; A hits
  np.testing.assert_allclose(locality.cache_hit_rate(ids2, 4, 2, "lfu"), [3 / 8])


def test_current_token_is_never_evicted_and_budget_below_k():
  # k = 2, capacity 1: each token's selections both miss; only one stays resident
  ids = np.array([[0, 1], [0, 2], [1, 0]])[:, None, :]
  # t0: miss miss, keeps 0; t1: 0 hit, 2 miss (0 in use: 2 dropped after) -> keeps 0;
  # t2: 1 miss, 0 hit -> 2 hits of 6
  np.testing.assert_allclose(locality.cache_hit_rate(ids, 4, 1, "lru"), [2 / 6])


def test_layers_are_independent():
  a = np.array([0, 1, 0, 2, 1])
  b = np.array([3, 3, 3, 3, 3])
  ids = np.stack([a, b], 1)[:, :, None]
  np.testing.assert_allclose(locality.cache_hit_rate(ids, 4, 2, "lru"), [1 / 5, 4 / 5])


def test_shuffle_removes_locality_not_popularity():
  rng = np.random.default_rng(0)
  # documents of 200 tokens, each using its own 4 experts of 32 (k = 2)
  docs = [rng.choice(32, 4, replace=False) for _ in range(20)]
  ids = np.concatenate([np.stack([rng.choice(d, 2, replace=False) for _ in range(200)])
                        for d in docs])[:, None, :]
  cur = locality.locality_curve(ids, 32, fractions=(0.25,), evictions=("lru",))
  r = cur["lru"][0.25]
  assert r["capacity"] == 8
  assert r["ordered"] > 0.9 and r["shuffled"] < 0.5
  shares = locality.load_shares(ids, 32)
  chex.assert_shape(shares, (1, 32))
  assert shares.sum() == pytest.approx(1.0)


def test_bad_eviction():
  with pytest.raises(ValueError, match="eviction"):
    locality.cache_hit_rate(np.zeros((2, 1, 1), int), 4, 2, "fifo")
