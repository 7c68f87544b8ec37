"""The one table of hardware profiles, and the model shapes they are applied to (data, with sources).

A *hardware profile* is a GPU, the link its experts cross, and the host that
holds them.  A *model shape* says how many bytes a decode step reads.  At batch
1 decode is memory-bound, so bytes / bandwidth gives the times both users need:

  the scaled link (moejax.offload.link, ``--link=scaled:MODEL@GPU``) takes the
    ratio rho = one expert's transfer time / one layer's decode compute time
    (`HardwareProfile.ratio`; link latency is not part of rho);
  the simulator's time model (`moejax.research.timemodel.roofline`) takes
    per-layer times: bytes / GPU memory bandwidth for attention, router and each
    expert; expert bytes / link bandwidth (+ latency) per transfer; expert bytes
    / host memory bandwidth for an expert computed on the host CPU (the
    llama.cpp / Fiddler baseline).  Kernel-launch and framework overheads are
    not in the roofline (a lower bound on compute time).

It sits in offload (the scaled link needs it) and research imports it from
here: offload may not import research.

Sources for the figures (peak figures are vendor data sheets; "effective"
figures are what published measurements typically reach, rounded):
  RTX 3090     936 GB/s GDDR6X (NVIDIA GeForce RTX 3090 specifications).
  RTX 4090     1008 GB/s GDDR6X (NVIDIA GeForce RTX 4090 specifications).
  A100 PCIe    1935 GB/s HBM2e, 80 GB card (NVIDIA A100 data sheet).
  H100 SXM     3.35 TB/s HBM3 (NVIDIA H100 data sheet).
  H200         4.8 TB/s HBM3e (NVIDIA H200 data sheet).
  GH200        4.0 TB/s HBM3, 96 GB version (NVIDIA GH200 data sheet; the
               144 GB HBM3e version lists 4.9 TB/s).
  PCIe 4.0 x16 31.5 GB/s per direction raw (PCI-SIG 16 GT/s x 16 lanes,
               128b/130b); pinned host->device copies measure ~25 GB/s
               (CUDA bandwidthTest on such systems), used here.
  PCIe 5.0 x16 63 GB/s per direction raw (32 GT/s); ~50 GB/s effective pinned
               copies.
  NVLink-C2C   900 GB/s total, 450 GB/s per direction (NVIDIA Grace Hopper
               superchip whitepaper); ~400 GB/s effective host->device assumed.
  DMA latency  ~10 us per cudaMemcpyAsync over PCIe (launch + DMA set-up, the
               order reported by microbenchmarks); ~5 us over C2C (assumed).
  Host memory  (CPU expert compute, memory-bound): desktop DDR4-3200 dual
               channel 51.2 GB/s peak -> 40 GB/s; desktop DDR5-5600 dual
               channel 89.6 GB/s -> 70 GB/s; server 8-channel DDR4-3200
               204.8 GB/s -> 150 GB/s; server 8-channel DDR5-4800 307 GB/s ->
               230 GB/s; Grace LPDDR5X 500 GB/s peak (Grace CPU data sheet)
               -> 400 GB/s.  The ~75-80% ratio is what STREAM-like reads reach.
  Disks, the tier below host RAM (a miss that is not in the page cache or a host
  staging cache is read from here; as a profile's "link" they give the time model
  and the scaled link a model whose experts are read from disk):
               NVMe PCIe 4.0 x4 7.0-7.45 GB/s sequential reads (vendor data
               sheets, e.g. Samsung 990 PRO); ~5 GB/s assumed for 9 MB reads at low
               queue depth; ~80 us per request (4K random reads at QD1 measure
               50-100 us).  SATA SSD 6 Gb/s: ~0.55 GB/s peak -> 0.5 GB/s, ~100 us.
               This VM's disk: direct reads measured at 0.56-0.82 GB/s (one Qwen3-
               30B-A3B expert in 11-17 ms; docs/engine.md "Memory tiers") -> 0.7 GB/s,
               100 us assumed; its CPU reads memory at ~30 GB/s on two threads
               (measured, AVX-512 loads), the "gpu memory" of a CPU-only profile.
  "this machine (emulated link)": no datasheet; its compute times are measured
               by timing the engine here (`timemodel.calibrate_engine`) and its
               link is the emulated one the engine ran with.
Model shapes are counted from the checkpoints' configs (REFERENCE.md); the
derivation of Qwen3-30B-A3B's bytes and rho is in moejax.offload.link.
"""

from __future__ import annotations

import dataclasses


class ProfileError(ValueError):
  """An unknown profile or model shape; the message lists the known ones."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """Bytes one decode step reads (bf16 unless said), per MoE layer and per token."""
  name: str
  moe_layers: int
  num_experts: int
  top_k: int
  expert_bytes: int            # one routed expert (what a fetch moves)
  layer_bytes: int             # attention/mixer + router + norms + shared expert, per layer
  head_bytes: int              # LM head (+ final norm) per token
  title: str = ""              # the checkpoint's own spelling, for printed link names

  @property
  def layer_active_bytes(self) -> int:
    """Bytes one MoE layer reads per decoded token: the layer plus its top-k experts."""
    return self.layer_bytes + self.top_k * self.expert_bytes


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """A GPU, the link its experts cross and the host that holds them."""
  name: str
  gpu: str
  link: str
  gpu_memory_Bps: float
  link_Bps: float              # effective pinned host->device bandwidth
  link_latency_s: float
  host_memory_Bps: float       # effective host-CPU read bandwidth (host expert compute)
  devices: int = 1             # expert-parallel GPUs, each with this link ("rtx3090x4")
  collective_s: float = 0.0    # one MoE layer's all-reduce of a token's partial outputs

  def expert_transfer_s(self, shape: ModelShape) -> float:
    """One expert of `shape` over the link (no latency)."""
    return shape.expert_bytes / self.link_Bps

  def layer_compute_s(self, shape: ModelShape) -> float:
    """One MoE layer's decode time of `shape` at batch 1 (the memory roofline)."""
    return shape.layer_active_bytes / self.gpu_memory_Bps

  def ratio(self, shape: ModelShape) -> float:
    """rho = one expert's transfer time / one layer's decode compute time."""
    return self.expert_transfer_s(shape) / self.layer_compute_s(shape)

  def title(self, shape: ModelShape) -> str:
    return f"{shape.title or shape.name} on {self.gpu} ({self.link})"


HARDWARE: dict[str, HardwareProfile] = {p.name: p for p in [
    HardwareProfile("rtx3090", "RTX 3090", "PCIe 4.0 x16", 936e9, 25e9, 10e-6, 40e9),
    HardwareProfile("rtx4090", "RTX 4090", "PCIe 4.0 x16", 1008e9, 25e9, 10e-6, 70e9),
    HardwareProfile("a100", "A100 PCIe 80GB", "PCIe 4.0 x16", 1935e9, 25e9, 10e-6, 150e9),
    HardwareProfile("h100", "H100 SXM", "PCIe 5.0 x16", 3.35e12, 50e9, 10e-6, 230e9),
    HardwareProfile("h200", "H200", "PCIe 5.0 x16", 4.8e12, 50e9, 10e-6, 230e9),
    HardwareProfile("gh200", "GH200 (96 GB)", "NVLink-C2C", 4.0e12, 400e9, 5e-6, 400e9),
    # experts on disk: the link is the disk (CPU-only profiles: "gpu" memory is RAM)
    HardwareProfile("rtx3090_nvme", "RTX 3090", "NVMe PCIe 4.0 SSD", 936e9, 5e9, 80e-6, 40e9),
    HardwareProfile("ddr5_nvme", "CPU (DDR5-5600 dual channel)", "NVMe PCIe 4.0 SSD", 70e9,
                    5e9, 80e-6, 70e9),
    HardwareProfile("ddr4_sata", "CPU (DDR4-3200 dual channel)", "SATA SSD", 40e9, 0.5e9,
                    100e-6, 40e9),
    HardwareProfile("vm_disk", "this 2-core VM", "its virtual disk (measured)", 30e9, 0.7e9,
                    100e-6, 30e9),
]}
CALIBRATED = "this_machine"    # a profile measured by timing the engine (timemodel)


# A small all-reduce (one token's hidden vector) between GPUs is latency-bound: NCCL's
# small-message all-reduce takes ~10-20 us over PCIe and ~5-10 us over NVLink (nccl-tests
# all_reduce_perf at 8 B - 8 KB, order of magnitude; assumed, not measured here).
COLLECTIVE_S = {"PCIe 4.0 x16": 20e-6, "PCIe 5.0 x16": 15e-6, "NVLink-C2C": 8e-6}


def hardware(name: str) -> HardwareProfile:
  """A profile by name; "NAMExN" is N of NAME's GPUs, expert-parallel (each its own link
  to the host, every MoE layer one all-reduce)."""
  base, sep, n = name.rpartition("x")
  if sep and base in HARDWARE and n.isdigit() and int(n) >= 1:
    hw = HARDWARE[base]
    return dataclasses.replace(hw, name=name, devices=int(n), gpu=f"{n} x {hw.gpu}",
                               collective_s=COLLECTIVE_S.get(hw.link, 20e-6) if int(n) > 1
                               else 0.0)
  if name not in HARDWARE:
    raise ProfileError(f"--profiles: unknown hardware profile {name!r}; known: "
                       f"{', '.join(list(HARDWARE) + [CALIBRATED])}, and NAMExN for N "
                       f"expert-parallel GPUs (e.g. rtx3090x4)")
  return HARDWARE[name]


def moe_layer_bytes(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    num_experts: int, top_k: int, expert_inter: int,
                    bytes_per_param: int = 2) -> tuple[int, int]:
  """(expert bytes, active bytes per layer per token) of a qwen3_moe-style layer.

  Active bytes: q/k/v/o projections + router + the two RMSNorms and the q/k
  head norms + top_k experts (gate, up, down).
  """
  expert = 3 * hidden * expert_inter
  attention = (hidden * num_heads * head_dim * 2 + hidden * num_kv_heads * head_dim * 2)
  router = num_experts * hidden
  norms = 2 * hidden + 2 * head_dim
  return (expert * bytes_per_param,
          (attention + router + norms + top_k * expert) * bytes_per_param)


def _qwen3_30b() -> ModelShape:
  # REFERENCE: 48 layers, hidden 2048, 32/4 heads x 128, 128 experts top-8 of 768, vocab
  # 151936, untied head.  moe_layer_bytes counts q/k/v/o + router + norms + k experts.
  expert, active = moe_layer_bytes(2048, 32, 4, 128, 128, 8, 768)
  return ModelShape("qwen3-30b-a3b", 48, 128, 8, expert, active - 8 * expert,
                    151936 * 2048 * 2, title="Qwen3-30B-A3B")


def _qwen3_next_80b() -> ModelShape:
  # REFERENCE: 48 layers, hidden 2048; every 4th layer gated full attention (16/2 heads x
  # 256, q_proj gives [q | gate]), the others Gated DeltaNet (16 key heads x 128, 32 value
  # heads x 128: in_proj_qkvz 2048 x 12288, in_proj_ba 2048 x 64, out_proj 4096 x 2048);
  # 512 experts top-10 of 512; one sigmoid-gated shared expert of 512; vocab 151936.
  h = 2048
  attn = h * (16 * 256 * 2) + 2 * h * 2 * 256 + 16 * 256 * h
  delta = h * 12288 + h * 64 + 4096 * h
  mixer = (12 * attn + 36 * delta) // 48
  shared = 3 * h * 512 + h
  router = 512 * h
  return ModelShape("qwen3-next-80b-a3b", 48, 512, 10, 3 * h * 512 * 2,
                    2 * (mixer + shared + router + 2 * h), 151936 * h * 2,
                    title="Qwen3-Next-80B-A3B")


MODELS: dict[str, ModelShape] = {m.name: m for m in [_qwen3_30b(), _qwen3_next_80b()]}


def model_shape(name: str) -> ModelShape:
  if name not in MODELS:
    raise ProfileError(f"unknown model shape {name!r}; known: {', '.join(MODELS)}")
  return MODELS[name]


DEFAULT_MODEL = "qwen3-30b-a3b"
DEFAULT_SCALED = f"{DEFAULT_MODEL}@rtx3090"   # --link=scaled


def scaled_profile(key: str) -> tuple[str, ModelShape, HardwareProfile]:
  """'MODEL@GPU' (or 'GPU' for DEFAULT_MODEL) -> (canonical key, shape, profile)."""
  k = key.strip().lower()
  model, _, gpu = k.rpartition("@")
  model = model or DEFAULT_MODEL
  if model not in MODELS or gpu not in HARDWARE:
    raise ProfileError(f"unknown hardware profile {key!r}; known: MODEL@GPU with MODEL one of "
                       f"{', '.join(MODELS)} and GPU one of {', '.join(HARDWARE)}")
  return f"{model}@{gpu}", MODELS[model], HARDWARE[gpu]
