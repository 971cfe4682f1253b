"""A DDP gradient reduction whose result does not depend on DDP's bucket layout.

A DDP built anew (as resilient mode's training function does after a recovery) runs
its first iteration with buckets in parameter order and rebuilds them afterwards in the
order gradients arrive. gloo's ring all-reduce sums an element in an order that depends
on its offset in the bucket, so a fresh DDP changes the low bits of that step's
gradients: the run is correct but not bit-identical to a run without the rebuild. This
communication hook all-gathers each bucket and sums the ranks' copies in rank order:
every element is reduced the same way whatever the layout (world x the bucket's memory
and traffic: for small models, tests, and anyone who needs bit-exact reproducibility).

    ddp.register_comm_hook(None, ordered_allreduce_hook)
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import torch
import torch.distributed as dist


def ordered_allreduce_hook(process_group: object,
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the ranks, summing in rank order."""
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    gathered = torch.empty(world * buf.numel(), dtype=buf.dtype, device=buf.device)
    fut = dist.all_gather_single(gathered, buf, group=group, async_op=True).get_future()

    def reduce(f: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
        f.value()  # re-raises the collective's error (a dead peer): never sum garbage
        rows = gathered.view(world, -1)
        out = rows[0].clone()
        for r in range(1, world):
            out.add_(rows[r])
        return out.div_(world)

    return fut.then(reduce)
