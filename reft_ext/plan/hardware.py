"""Hardware figures the planner needs, with named profiles, and the training-cost
estimator built on them (docs/design.md: days = tokens x 6W / (GPUs x peak FLOP/s x MFU)).

Figures are per device (GPU, or GCD for MI250X) unless named per node. They are vendor
peak or commonly measured values, rounded; a real cluster's own measurements (for D2H, a
pinned ``cudaMemcpyAsync`` with all GPUs of a node copying at once) should replace them:
every field is a flag (``--d2h-bandwidth 12e9`` ...) that overrides the profile.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from reft_ext.plan.common import fail, flag_of, positive
from reft_ext.plan.common import flag_field as _f

GB = 1e9

PROFILE_FIELDS = ("device_flops", "mfu", "d2h_bandwidth", "device_memory_bandwidth",
                  "device_memory", "host_memory_bandwidth", "network_bandwidth",
                  "host_memory")
#        peak 16-bit   MFU   D2H     HBM BW     HBM       host BW   network   host mem
#        FLOP/s              B/s     B/s        B         per node  per node  per node
_TABLE = {
    # DGX-1 V100 SXM2 32 GB: fp16 tensor cores, PCIe 3 x16, 4x EDR InfiniBand
    "V100": (125e12, 0.35, 12 * GB, 900 * GB, 32 * GB, 100 * GB, 50 * GB, 512 * GB),
    # DGX A100 80 GB: bf16, PCIe 4 x16, 8x HDR InfiniBand
    "A100": (312e12, 0.45, 25 * GB, 2000 * GB, 80 * GB, 300 * GB, 200 * GB, 1024 * GB),
    # DGX H100 80 GB: bf16 dense, PCIe 5 x16, 8x NDR InfiniBand
    "H100": (989e12, 0.45, 50 * GB, 3350 * GB, 80 * GB, 450 * GB, 400 * GB, 2048 * GB),
    # Frontier node: 4 MI250X = 8 GCDs (one rank each, figures per GCD), Infinity Fabric
    # CPU-GCD links (36 GB/s each way), 8-channel DDR4-3200, 4x Slingshot-11
    "MI250X": (191.5e12, 0.3, 36 * GB, 1600 * GB, 64 * GB, 150 * GB, 100 * GB, 512 * GB),
    # this project's 2-core CPU machine, measured once (fp32 matmul, 256 MB copy_);
    # ``--hardware cpu --measure`` measures again
    "cpu": (50e9, 1.0, 2 * GB, 2 * GB, 24 * GB, 2 * GB, 1 * GB, 24 * GB),
}
PROFILES = {name: dict(zip(PROFILE_FIELDS, row)) for name, row in _TABLE.items()}


@dataclass
class HardwareConfig:
    """Speeds and sizes (bytes, bytes/s, FLOP/s); 0 = the profile's figure."""

    hardware: str = _f("H100", "profile: " + ", ".join(PROFILES) + ", or custom (then "
                               "give every figure)")
    device_flops: float = _f(0.0, "peak dense 16-bit FLOP/s of one device")
    mfu: float = _f(0.0, "model FLOPs utilisation: achieved fraction of the peak")
    d2h_bandwidth: float = _f(0.0, "device-to-host copy bytes/s per device, all devices "
                                   "copying (BW_io of Algorithm 1)")
    device_memory_bandwidth: float = _f(0.0, "device memory bytes/s (AEC's XOR on device)")
    device_memory: float = _f(0.0, "device memory bytes")
    host_memory_bandwidth: float = _f(0.0, "host memory bytes/s of one node (all ranks)")
    network_bandwidth: float = _f(0.0, "inter-node bytes/s of one node (all NICs)")
    host_memory: float = _f(0.0, "host memory bytes of one node")

    def __post_init__(self):
        # names are matched case-insensitively (``--hardware v100`` is V100) and kept in
        # the profile's spelling, which the reports and LINK_SHARED use
        canonical = {name.lower(): name for name in (*PROFILES, "custom")}
        if str(self.hardware).lower() not in canonical:
            fail("--hardware", f"unknown profile {self.hardware!r}; choose from "
                               f"{', '.join(PROFILES)} or custom")
        self.hardware = canonical[str(self.hardware).lower()]
        base = PROFILES.get(self.hardware, {})
        for name in PROFILE_FIELDS:
            if not getattr(self, name):
                if name not in base:
                    fail(flag_of(HardwareConfig, name), "required with --hardware custom")
                setattr(self, name, base[name])
        positive(HardwareConfig, self, *PROFILE_FIELDS)
        if self.mfu > 1:
            fail("--mfu", f"a fraction of the peak, (0, 1], got {self.mfu}")

    @property
    def achieved_flops(self) -> float:
        return self.device_flops * self.mfu


def measure_cpu(seconds: float = 0.3) -> HardwareConfig:
    """'This CPU' measured now: fp32 matmul FLOP/s of all cores (as device_flops, MFU 1)
    and a 64 MB tensor copy (as D2H, device and host memory bandwidth)."""
    import torch

    a = torch.randn(512, 512)
    a @ a
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2:
        a @ a
        n += 1
    flops = 2 * 512 ** 3 * n / (time.perf_counter() - t0)
    src = torch.ones(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2:
        dst.copy_(src)
        n += 1
    bw = src.numel() * n / (time.perf_counter() - t0)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return replace(HardwareConfig("cpu"), device_flops=flops, d2h_bandwidth=bw,
                   device_memory_bandwidth=bw, host_memory_bandwidth=bw,
                   device_memory=mem, host_memory=mem)


# ---- training cost -----------------------------------------------------------------
DAY = 86400.0


@dataclass
class CostConfig:
    """What a run must compute; unset fields come from the planned model and layout."""

    train_tokens: float | None = _f(None, "tokens to train on (enables the cost estimate)")
    num_parameters: float | None = _f(None, "model parameters W (default: the model's)")
    num_gpus: int | None = _f(None, "devices (default: the layout's world size)")
    flops_per_parameter_token: float = _f(6.0, "training FLOPs per parameter and token: 6 "
                                               "(fwd 2 + bwd 4), 8 with full recompute")

    def __post_init__(self):
        positive(CostConfig, self, "train_tokens", "num_parameters", "num_gpus",
                 "flops_per_parameter_token")


def training_flops(tokens: float, parameters: float, per_token: float = 6.0) -> float:
    return per_token * parameters * tokens


def training_days(tokens: float, parameters: float, gpus: int, device_flops: float,
                  mfu: float, per_token: float = 6.0) -> float:
    """Days of pure training compute (no failures, no restarts)."""
    return training_flops(tokens, parameters, per_token) / (gpus * device_flops * mfu) / DAY


def estimate(cfg: CostConfig, parameters: float, gpus: int, device_flops: float,
             mfu: float, goodput: dict | None = None) -> dict:
    """The estimate as a dict: compute days, GPU-hours, and wall-clock days at the
    reliability model's goodput (with and without REFT) when given."""
    w = cfg.num_parameters or parameters
    n = cfg.num_gpus or gpus
    days = training_days(cfg.train_tokens, w, n, device_flops, mfu,
                         cfg.flops_per_parameter_token)
    out = {"train_tokens": cfg.train_tokens, "parameters": w, "gpus": n,
           "device_flops": device_flops, "mfu": mfu,
           "flops": training_flops(cfg.train_tokens, w, cfg.flops_per_parameter_token),
           "compute_days": days, "gpu_hours": days * 24 * n}
    if goodput:
        out["wall_days"] = {k: days / g if g > 0 else float("inf")
                            for k, g in goodput.items()}
    return out
