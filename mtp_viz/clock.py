"""A clock that is correct on every device.

CUDA kernels run asynchronously, so a host timer read without a barrier measures the launch, not
the work. `Clock.now()` synchronises the device first; on CPU it is a plain `perf_counter`.
"""

import time

import torch


class Clock:
    def __init__(self, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self._sync = device.type == "cuda"
        self._device = device

    def now(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()
