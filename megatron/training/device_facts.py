"""The facts about a rank's machine that argument validation judges flags by: the device
type, how many devices a node has, and which library supplies the optimizers megatron-core
builds (TransformerEngine, apex or torch: megatron.core.optimizer tries them in that
order). A start probes them (:meth:`DeviceFacts.probe`); a test of a cluster script
supplies those of its target instead (tests/integration/test_example_validation.py), so
the whole validation runs on this CPU machine as it would on an 8-GPU node."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

DEVICES = ("cpu", "cuda")  # ROCm's torch is "cuda" too, with a HIP version


@dataclass(frozen=True)
class DeviceFacts:
    device: str = "cpu"              # where the model and optimizer live: cpu | cuda
    count: int = 0                   # devices per node (0 on cpu)
    hip: str | None = None           # torch.version.hip on ROCm, else None
    optimizers: str = "torch"        # transformer_engine | apex | torch (FusedAdam/FusedSGD
                                     # from the first two, torch's AdamW/SGD otherwise)
    te_missing: str | None = "no CUDA device here"  # why TE cannot run; None: it can

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"DeviceFacts.device: {self.device!r} is not one of {DEVICES}")
        if self.optimizers not in ("transformer_engine", "apex", "torch"):
            raise ValueError(f"DeviceFacts.optimizers: {self.optimizers!r}")

    @property
    def platform(self) -> str:
        return "rocm" if self.hip else self.device

    @classmethod
    def probe(cls) -> "DeviceFacts":
        """This machine's facts, without building anything (no model import on a CPU
        start: a bad flag stays a one-line error there)."""
        import torch

        if not torch.cuda.is_available():
            return cls()
        import warnings

        with warnings.catch_warnings():  # megatron-core's import notes: not an error
            warnings.simplefilter("ignore")
            from megatron.training.llama_model import transformer_engine_missing
        return cls("cuda", torch.cuda.device_count(), getattr(torch.version, "hip", None),
                   optimizer_source(), transformer_engine_missing())

    @classmethod
    def node_of(cls, platform: str, count: int = 8, optimizers: str = "transformer_engine"):
        """A cluster node's facts as its software stack gives them: ``cuda`` (an NVIDIA
        node with TE) or ``rocm`` (an AMD node: TE's ROCm port or apex)."""
        if platform not in ("cuda", "rocm"):
            raise ValueError(f"platform {platform!r}: cuda or rocm")
        return cls("cuda", count, "6.2" if platform == "rocm" else None, optimizers, None)


def optimizer_source() -> str:
    """Who supplies megatron-core's Adam/SGD here, by its own import order."""
    for name, spec in (("transformer_engine", "transformer_engine.pytorch.optimizers"),
                       ("apex", "apex.optimizers")):
        try:
            if importlib.util.find_spec(spec) is not None:
                return name
        except Exception:  # noqa: BLE001 - a parent package that does not import here
            continue
    return "torch"
