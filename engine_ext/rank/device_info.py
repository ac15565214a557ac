"""What a rank knows about the GPU it runs on, for status: which physical device it is (ranks that
share one see the same UUID, whatever index CUDA_VISIBLE_DEVICES gives it) and whether NVIDIA's
Multi-Process Service is up for it. Processes sharing a GPU without MPS have their CUDA contexts
time-sliced: their kernels take turns, and together they serve less than one rank would."""

from __future__ import annotations

import os

import torch

MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"  # the control daemon's pipe directory unless CUDA_MPS_PIPE_DIRECTORY says


def device_uuid(device: torch.device) -> str:
    """The physical GPU's UUID ("" for a CPU rank, or where torch does not say)."""
    if device.type != "cuda":
        return ""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError):
        return ""


def mps_active(device: torch.device) -> bool | None:
    """Whether an MPS control daemon answers where this process's CUDA clients look for it (its
    ``control`` pipe exists); None for a CPU rank."""
    if device.type != "cuda":
        return None
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT
    return os.path.exists(os.path.join(pipe_dir, "control"))
