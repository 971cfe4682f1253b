"""Let TorchTitan 0.3.0 train on CPU over gloo: five spots, patched at import time.

Import this module before anything else of ``torchtitan``. Nothing in the installed
package is edited; each patch replaces one function or module attribute:

1. ``tools/utils.py``: with no accelerator TorchTitan falls back to ``"cuda"``; here the
   device type is ``"cpu"`` (``torch.cpu`` as the device module) and every rank's local
   device is the CPU.
2. ``components/metrics.py``: the device memory monitor reads CUDA allocator statistics;
   on CPU it reports zeros.
3. ``distributed/fsdp.py``: TorchTitan turns FSDP's gradient division off (it scales by
   the global token count itself), which makes FSDP2 reduce-scatter with ``PREMUL_SUM``:
   gloo lacks it. FSDP is told to reduce with plain sums instead (the same numbers:
   the division factor is 1).
4. ``distributed/utils.py``: ``set_pg_timeouts`` calls a barrier with CUDA device ids and
   ``torch.distributed.set_timeout`` (absent in torch 2.13): it becomes a plain barrier.
5. ``tools/utils.py``: ``get_peak_flops`` runs ``lspci`` to name a GPU; on CPU it returns
   the default without a subprocess.
6. ``models/llama3``: FlexAttention has no backward pass on CPU, and the model registry
   refuses ``attn_backend="sdpa"`` for language models; here ``"sdpa"`` gives
   ``ScaledDotProductAttention`` (plain causal attention, no per-document mask: the
   maskless configuration TorchTitan's own graph-trainer tests use).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torchtitan.tools.utils as tt_utils

tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
tt_utils.get_local_device = lambda: torch.device("cpu")
tt_utils.get_peak_flops = lambda device_name: 312e12  # TorchTitan's own default

import torchtitan.components.metrics as tt_metrics  # noqa: E402  (after the device patch)
import torchtitan.distributed.fsdp as tt_fsdp  # noqa: E402
import torchtitan.distributed.utils as tt_dist_utils  # noqa: E402
import torchtitan.models.llama3 as tt_llama3  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402


class _CPUMemoryMonitor:
    device_name = "cpu"
    device_capacity_gib = 0.0

    def get_peak_stats(self) -> Any:
        return tt_metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


tt_metrics.build_device_memory_monitor = _CPUMemoryMonitor


def _sum_reduction(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, tt_fsdp.FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


tt_fsdp.disable_fsdp_gradient_division = _sum_reduction
tt_dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: dist.barrier()

_attention_config = tt_llama3.get_attention_config
tt_llama3.get_attention_config = (
    lambda backend: ScaledDotProductAttention.Config() if backend == "sdpa"
    else _attention_config(backend))
