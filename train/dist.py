"""Distributed set-up for one process or many (accelerate launch): the process group, the Accelerator (DDP or
DeepSpeed ZeRO from the launch config), mixed precision and the frozen target's placement.

On a machine without CUDA and more than one process, the process group must use gloo: otherwise
accelerate leaves every rank believing it is rank 0 of 1, silently.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from train.models import native_bf16


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


def mixed_precision(setting: str) -> str:
    """`auto`: bf16 autocast on a GPU that supports it and on a CPU that multiplies bf16 natively; else none."""
    if setting != "auto":
        return setting
    return "bf16" if native_bf16(torch.device("cuda" if torch.cuda.is_available() else "cpu")) else "no"


def make_accelerator(recipe):
    """The run's Accelerator (DDP or DeepSpeed from the launch config), created before any model is loaded
    so that a ZeRO-3 config partitions the models as they load."""
    from accelerate import Accelerator

    distributed_state()  # gloo + MULTI_CPU on a machine without CUDA
    section = recipe.distill
    log_with = "wandb" if recipe.tracking.report_to == "wandb" else None
    accelerator = Accelerator(mixed_precision=mixed_precision(section.mixed_precision),
                              gradient_accumulation_steps=section.grad_accum, log_with=log_with,
                              project_dir=str(recipe.run_dir))
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        # No dataloader is prepared, so the "auto" batch values are filled here from the recipe.
        config = plugin.deepspeed_config
        config["train_micro_batch_size_per_gpu"] = section.batch_size
        config["gradient_accumulation_steps"] = section.grad_accum
        config["train_batch_size"] = section.batch_size * section.grad_accum * accelerator.num_processes
        config["gradient_clipping"] = section.max_grad_norm
    return accelerator


def zero_stage(accelerator) -> int:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return int(plugin.zero_stage) if plugin is not None else -1


def prepare_target(accelerator, target):
    """The frozen target: under ZeRO-3 a second DeepSpeed engine (inference only) so its weights stay
    partitioned across processes; otherwise the model itself on this process's device."""
    target.eval()
    target.requires_grad_(False)
    if zero_stage(accelerator) != 3:
        return target.to(accelerator.device)
    import deepspeed

    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    config = {
        "train_micro_batch_size_per_gpu": ds["train_micro_batch_size_per_gpu"],
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e4},
        "bf16": {"enabled": accelerator.mixed_precision == "bf16"},
        "fp16": {"enabled": accelerator.mixed_precision == "fp16"},
    }
    engine, *_ = deepspeed.initialize(model=target, config=config)
    engine.eval()
    return engine
