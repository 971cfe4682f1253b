"""TorchTitan's Llama-3 debug model trained with FSDP2 by TorchTitan's own ``Trainer``, in
resilient mode.

    python examples/torchtitan/make_assets.py          # once: tokenizer + c4_test stand-ins
    tp-run --nproc-per-node 2 --spares 1 --shard-copy-every 1 \\
        examples/torchtitan/train_llama3.py --steps 20 --kill-rank 1 --kill-step 10

Each generation builds a TorchTitan ``Trainer`` (model on the meta device, FSDP2 by
``parallelize_llama``, weight init, AdamW, the warmup/decay LR schedule, the
``c4_test`` data loader) around the process group ``resilient.run`` made, and the loop
calls the trainer's own ``train_step``. Registered with ``State(build=...)``: the FSDP
model, the AdamW optimizer, its LR scheduler, the data loader's position (each rank's
own) and the trainer's counters. A killed rank's spare receives its shards and loader
position from the buddy copy on the other rank (plain FSDP) or, with ``--replicas 2``
on 4 ranks, from its HSDP replica peer; the job ends with the checksum the same command
prints under ``torchrun`` without the kill. Runs unchanged under torchrun.

Needs ``pip install torchtitan==0.3.0`` (and its dependencies) beside tp-run;
``cpu_patches`` lets it run on CPU over gloo (see that module).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import cpu_patches  # noqa: E402,F401  (before any other torchtitan import)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchtitan.config import ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from tp_launch import resilient  # noqa: E402


class GroupTrainer(Trainer):
    """TorchTitan's trainer on a process group that exists already (``resilient.run``
    makes one per generation)."""

    def init_distributed(self) -> ParallelDims:
        return ParallelDims.from_config(self.config.parallelism, dist.get_world_size())


class LoaderPosition:
    """The data loader's position as plain values: ``ParallelAwareDataloader`` pickles
    its state into bytes, which a newcomer would then unpickle from a peer."""

    def __init__(self, loader: StatefulDataLoader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return StatefulDataLoader.state_dict(self.loader)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        StatefulDataLoader.load_state_dict(self.loader, sd)


def config(args: argparse.Namespace) -> Trainer.Config:
    cfg = llama3_debugmodel()
    cfg.model_spec = model_registry("debugmodel", attn_backend="sdpa")
    cfg.hf_assets_path = str(args.assets / "tokenizer")
    cfg.dataloader.dataset_path = str(args.assets / "c4_test")
    # float32 compute: bfloat16 (TorchTitan's default for FSDP's all-gathered parameters) has no
    # fast CPU kernel without AVX512-BF16, and ran every matmul here ~15x slower.
    cfg.training = TrainingConfig(local_batch_size=2, seq_len=128, steps=args.steps,
                                  mixed_precision_param="float32")
    cfg.parallelism = ParallelismConfig(data_parallel_replicate_degree=args.replicas,
                                        spmd_backend="partial_dtensor")
    cfg.activation_checkpoint = None
    cfg.validator.enable = False
    cfg.checkpoint.enable = False
    cfg.debug.seed = 0  # the same run every time (TorchTitan draws one otherwise)
    cfg.metrics.log_freq = 5
    cfg.dump_folder = str(args.dump)
    return cfg


def build(gen: resilient.Generation, args: argparse.Namespace) -> dict[str, Any]:
    trainer = GroupTrainer(config(args))
    assert len(trainer.model_parts) == 1 and len(trainer.optimizers.optimizers) == 1
    return {"trainer": trainer, "model": trainer.model_parts[0],
            "optimizer": trainer.optimizers.optimizers[0],
            "lr_scheduler": trainer.lr_schedulers.schedulers[0],
            "loader": LoaderPosition(trainer.dataloader)}


def die(rank: int, step: int, where: str) -> None:
    print(f"rank {rank}: SIGKILL myself at step {step} ({where})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def arm_kill(state: resilient.State, rank: int, step: int, where: str) -> list[Any]:
    """Make this rank SIGKILL itself in this step: at its start, after the forward pass
    (the root module keeps its parameters unsharded until the backward pass), inside
    the backward pass (once the first block's gradient is due: the later blocks' are
    being reduce-scattered), or after the optimizer step. Returns the hooks' handles."""
    while "TP_RUN_CHANNEL" in os.environ and resilient.parked_spares() < 1:
        time.sleep(0.05)  # demo: make sure a spare is there to take over
    model = state.model
    first_block = next(iter(model.layers.values()))
    kill = lambda *_: die(rank, step, where)  # noqa: E731
    if where == "start":
        kill()
    if where == "forward":
        return [model.register_forward_hook(kill)]
    if where == "backward":
        def in_backward(module: Any, inputs: Any, output: torch.Tensor) -> None:
            output.register_hook(kill)  # (a forward hook's return value replaces the output)
        return [first_block.register_forward_hook(in_backward)]
    return [state.optimizer.register_step_post_hook(kill)]


def train(state: resilient.State, args: argparse.Namespace) -> None:
    trainer = state.trainer
    batches = trainer.batch_generator(trainer.dataloader)
    rank = dist.get_rank()
    for step in state.steps(args.steps):
        hooks = []
        if rank == args.kill_rank and step == args.kill_step \
                and os.environ.get("TP_RUN_SPARE") != "1":
            hooks = arm_kill(state, rank, step, args.kill_where)
        trainer.step = step + 1  # TorchTitan counts from 1
        trainer.train_step(batches)
        for h in hooks:
            h.remove()


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p  # a collective: every rank
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--assets", type=Path, default=Path(__file__).parent / "assets")
    parser.add_argument("--dump", type=Path, default=Path("/tmp") / f"titan-{os.getuid()}")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-where", default="start",
                        choices=["start", "forward", "backward", "optimizer"])
    args = parser.parse_args()
    if not (args.assets / "tokenizer" / "tokenizer.json").exists():
        sys.exit(f"error: no assets in {args.assets}: run examples/torchtitan/make_assets.py")

    if os.environ.get("RANK") == "0":
        init_logger()  # TorchTitan's step lines (loss, throughput), from rank 0
    state = resilient.State(build=lambda gen: build(gen, args), per_rank={"loader"})
    resilient.run(lambda s: train(s, args), state)
    digest = checksum(state.model)
    if dist.get_rank() == 0:
        print(f"done: {args.steps} steps on {dist.get_world_size()} ranks, "
              f"params {digest}", flush=True)
    state.trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
