"""Process state for one process or many (accelerate launch): rank, world size, device, barriers.

On a machine without CUDA and more than one process, the process group must use gloo: otherwise
accelerate leaves every rank believing it is rank 0 of 1, silently.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch


def distributed_state():
    """accelerate's PartialState, with the gloo backend when several processes share no GPU."""
    from accelerate import PartialState

    # Long enough for the main process to measure a checkpoint while the others wait at a barrier.
    kwargs = {"timeout": timedelta(hours=2)}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        kwargs["backend"] = "gloo"
        # cpu=True is what makes accelerate call this MULTI_CPU (and wrap models in DDP); without it a
        # MULTI_GPU launch config on a CPU machine gets a gloo group but DistributedType.NO. DeepSpeed
        # launches (DS_ACCELERATOR=cpu) must not set it: accelerate then skips DeepSpeed's own init.
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
            kwargs["cpu"] = True
    state = PartialState(**kwargs)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and state.num_processes != world:
        raise RuntimeError(f"launched with WORLD_SIZE={world} but the process group has {state.num_processes} processes")
    return state

