"""--link parsing, link timing arithmetic, hardware-profile scaling and the emulated link's
clock (`LinkClock`)."""

import pytest

from moejax.offload import hardware
from moejax.offload.hardware import moe_layer_bytes, scaled_profile
from moejax.offload.link import DEFAULT_PROFILE, NATIVE, Link, LinkClock, LinkSpecError, parse_link


def _ratio(key):
  _, shape, hw = scaled_profile(key)
  return hw.ratio(shape)


def test_native_link_costs_nothing_and_says_so():
  link = parse_link("native")
  assert link.bandwidth_Bps is None and not link.emulated
  assert link.transfer_time(10**9) == 0.0
  assert "native" in link.describe()
  assert parse_link(" Native ") == link


@pytest.mark.parametrize("spec,bw,lat", [
    ("16GB/s,10us", 16e9, 10e-6),
    ("16 GB/s + 10 us", 16e9, 10e-6),
    ("16GB/s+10us", 16e9, 10e-6),
    ("10us, 16GB/s", 16e9, 10e-6),
    ("500MB/s", 500e6, 0.0),
    ("1.5 GiB/s, 2ms", 1.5 * 2**30, 2e-3),
    ("2e9B/s + 100ns", 2e9, 100e-9),
    ("25 GB/s + 5 µs", 25e9, 5e-6),
])
def test_absolute_specs_parse(spec, bw, lat):
  link = parse_link(spec)
  assert link.bandwidth_Bps == pytest.approx(bw, rel=1e-12)
  assert link.latency_s == pytest.approx(lat, rel=1e-12, abs=1e-15)
  assert link.emulated


def test_transfer_time_is_bytes_over_bandwidth_plus_latency():
  link = parse_link("16GB/s,10us")
  # one Qwen3-30B-A3B expert: 9,437,184 B / 16e9 B/s = 589.824 us, + 10 us
  assert link.transfer_time(9_437_184) == pytest.approx(599.824e-6, rel=1e-9)
  assert link.transfer_time(0) == pytest.approx(10e-6)
  assert link.describe() == "emulated 16.0 GB/s + 10 us"
  assert Link("x", 1e6, 0.5).transfer_time(2_000_000) == pytest.approx(2.5)


@pytest.mark.parametrize("spec", [
    "", "fast", "16", "16GB", "16Gb/s", "10us", "0GB/s", "-5GB/s", "16GB/s,10us,3us",
    "16GB/s,8GB/s", "16 GB/s 10us", "scaled:nosuchgpu", "inf GB/s"])
def test_bad_specs_raise_naming_the_flag(spec):
  with pytest.raises(LinkSpecError) as e:
    parse_link(spec, expert_bytes=1000, layer_compute_s=1e-3)
  assert isinstance(e.value, ValueError)
  assert "--link" in str(e.value)


def test_error_names_a_custom_flag():
  with pytest.raises(LinkSpecError, match="--bench_link"):
    parse_link("warp speed", flag="--bench_link")


def test_qwen3_profile_numbers_match_their_derivation():
  expert, layer = moe_layer_bytes(2048, 32, 4, 128, 128, 8, 768)
  assert expert == 9_437_184  # REFERENCE.md, bf16
  # attention 37,748,736 + router 524,288 + norms 8,704 + 8 experts 75,497,472
  assert layer == 113_779_200
  key, shape, p = scaled_profile(DEFAULT_PROFILE)
  assert key == DEFAULT_PROFILE and shape.layer_active_bytes == layer
  assert shape.expert_bytes == expert
  assert (p.gpu, p.link) == ("RTX 3090", "PCIe 4.0 x16")
  assert p.expert_transfer_s(shape) == pytest.approx(377.48736e-6, rel=1e-9)
  assert p.layer_compute_s(shape) == pytest.approx(121.558974e-6, rel=1e-6)
  assert p.ratio(shape) == pytest.approx(3.10538, rel=1e-5)
  assert _ratio("qwen3-30b-a3b@h100") == pytest.approx(5.55718, rel=1e-5)
  assert _ratio("qwen3-30b-a3b@h200") == pytest.approx(7.96252, rel=1e-5)


def test_disk_profiles_hand_checked():
  """Experts read from disk: one Qwen3-30B-A3B expert over this VM's disk (0.7 GB/s)
  takes 13.5 ms (measured here: 11-17 ms); from an NVMe SSD (5 GB/s) 1.9 ms, 5x a
  PCIe 4.0 copy; rho is the expert's transfer over the layer's compute on that machine."""
  shape = hardware.model_shape("qwen3-30b-a3b")
  vm = hardware.hardware("vm_disk")
  assert vm.expert_transfer_s(shape) == pytest.approx(9_437_184 / 0.7e9)
  assert 11e-3 < vm.expert_transfer_s(shape) < 17e-3
  assert vm.layer_compute_s(shape) == pytest.approx(113_779_200 / 30e9)
  nvme = hardware.hardware("rtx3090_nvme")
  assert nvme.expert_transfer_s(shape) == pytest.approx(
      5 * hardware.hardware("rtx3090").expert_transfer_s(shape))
  key, _, p = scaled_profile("qwen3-30b-a3b@vm_disk")
  assert p is vm and p.ratio(shape) == pytest.approx((9_437_184 / 0.7e9) / (113_779_200 / 30e9))


def test_scaled_profiles_come_from_the_one_hardware_table():
  # the simulator's roofline and the scaled link read the same HardwareProfile
  assert scaled_profile("rtx3090")[2] is hardware.hardware("rtx3090")
  assert scaled_profile(" Qwen3-Next-80B-A3B@GH200 ")[0] == "qwen3-next-80b-a3b@gh200"
  with pytest.raises(hardware.ProfileError, match="known: MODEL@GPU .* rtx3090"):
    scaled_profile("qwen3-30b-a3b@rtx5090")
  with pytest.raises(LinkSpecError, match="--link=scaled:nosuch@h100: .*qwen3-30b-a3b"):
    parse_link("scaled:nosuch@h100", expert_bytes=1000, layer_compute_s=1e-3)


def test_scaled_link_reproduces_the_profile_ratio_here():
  # a local expert of 49,152 B and a 0.5 ms layer: bandwidth = 49152 / (3.10538 * 5e-4)
  link = parse_link("scaled", expert_bytes=49_152, layer_compute_s=5e-4)
  assert link.bandwidth_Bps == pytest.approx(31_655_983, rel=1e-6)
  assert link.latency_s == 0.0
  assert link.transfer_time(49_152) / 5e-4 == pytest.approx(
      _ratio(DEFAULT_PROFILE), rel=1e-12)
  assert "RTX 3090" in link.describe() and "emulated" in link.describe()
  assert link.profile == DEFAULT_PROFILE
  same = parse_link("scaled:qwen3-30b-a3b@rtx3090", expert_bytes=49_152, layer_compute_s=5e-4)
  assert same == link
  assert parse_link("scaled:rtx3090", expert_bytes=49_152, layer_compute_s=5e-4) == link
  h100 = parse_link("scaled:qwen3-30b-a3b@h100", expert_bytes=49_152, layer_compute_s=5e-4)
  assert h100.bandwidth_Bps < link.bandwidth_Bps  # a faster GPU makes the link relatively slower
  assert "H100" in h100.describe()
  d = link.as_dict()
  assert d["profile_ratio"] == pytest.approx(3.10538, rel=1e-5)
  assert d["bandwidth_Bps"] == link.bandwidth_Bps and "RTX 3090" in d["describe"]


def test_scaled_link_needs_local_measurements():
  with pytest.raises(LinkSpecError, match="--link=scaled.*expert_bytes and layer_compute_s"):
    parse_link("scaled")
  with pytest.raises(LinkSpecError, match="--link"):
    parse_link("scaled", expert_bytes=1000, layer_compute_s=0.0)


# ------------------------------------------------------------------ the emulated clock
# one expert of 1000 B on a 1000 B/s link with 0.1 s latency: 1 s an expert, + 0.1 s a burst;
# two MoE layers (0 and 2), 2 s of compute a token: 1 s a layer, 0.5 s before its decision
# (attention, router) and 0.5 s after (its experts)
SLOW = Link("test", 1000.0, 0.1)


def _approx(waits, **want):
  """waits equal to `want` (seconds), the waits not named zero."""
  full = {**dict(wait_s=0.0, admission_wait_s=0.0, prefetch_wait_s=0.0), **want}
  return waits == pytest.approx(full, abs=1e-12)


def test_native_clock_is_the_compute_time():
  clock = LinkClock(NATIVE, 1000, (0, 2))
  t, waits = clock.token(0.5, [3, 1], [2, 0], [0, 4])
  assert t == 0.5 and _approx(waits)


def test_clock_waited_fetches_and_admissions_hand_checked():
  clock = LinkClock(SLOW, 1000, (0, 2))
  # layer 0: decided at 0.5, its fetch 1.1 s, its experts 0.5 s (t = 2.1); its 2 admissions
  # queue behind: the link is busy until 2.1 + 2.1 = 4.2; layer 2: 1 s (t = 3.1)
  t, waits = clock.token(2.0, [1, 0], [2, 0], [0, 0])
  assert t == pytest.approx(3.1) and _approx(waits, wait_s=1.1)
  # the next token: layer 0 waits for its admissions (4.2 - 3.1 = 1.1 s into the token),
  # 1 s compute; layer 2: 1 s compute and a 1.1 s fetch
  t, waits = clock.token(2.0, [0, 1], [0, 0], [0, 0])
  assert t == pytest.approx(1.1 + 1 + 1 + 1.1) and _approx(waits, wait_s=1.1,
                                                           admission_wait_s=1.1)
  # nothing left on the link: a token without copies is its compute time
  t, waits = clock.token(2.0, [0, 0], [0, 0], [0, 0])
  assert t == pytest.approx(2.0) and _approx(waits)


def test_clock_prefetches_overlap_the_previous_layer_hand_checked():
  clock = LinkClock(SLOW, 1000, (0, 2))
  # two experts predicted for layer 2 are requested at layer 0's decision (t = 0.5) and
  # arrive at 0.5 + 2.1 = 2.6; layer 0's experts and layer 2's attention and router hide
  # 1 s of it: layer 2 waits 1.1 s before its experts, then computes them (t = 3.1)
  t, waits = clock.token(2.0, [0, 0], [0, 0], [0, 2])
  assert t == pytest.approx(3.1) and _approx(waits, prefetch_wait_s=1.1)
  # a waited fetch at layer 0 pushes them back by its 1.1 s
  clock.reset()
  t, waits = clock.token(2.0, [1, 0], [0, 0], [0, 2])
  assert _approx(waits, wait_s=1.1, prefetch_wait_s=1.1)
  clock.reset()                       # a new sequence: nothing on the link
  t, waits = clock.token(2.0, [0, 0], [1, 1], [0, 0])
  assert t == pytest.approx(2.0) and _approx(waits)
  clock.reset()
  t, waits = clock.token(2.0, [0, 0], [0, 0], [0, 0])   # the admissions forgotten
  assert t == pytest.approx(2.0) and _approx(waits)


def test_a_waited_fetch_pushes_back_the_admissions_queued_on_the_link():
  """The docstring: a layer's waited fetches take the link at once and the background
  transfers on it are pushed back.  Layer 0 requests 3 admissions at t = 1 (on the link
  until 4.1); layer 2's fetch takes the link at t = 1.5 for 1.1 s, so the admissions
  arrive at 5.2, 2.1 s into the next token (this one lasts 3.1 s): layer 0 waits 2.1 s
  for them there, not 1.0 s."""
  clock = LinkClock(SLOW, 1000, (0, 2))
  t, _ = clock.token(2.0, [0, 1], [3, 0], [0, 0])
  assert t == pytest.approx(3.1)
  t, waits = clock.token(2.0, [0, 0], [0, 0], [0, 0])
  assert waits["admission_wait_s"] == pytest.approx(2.1)
