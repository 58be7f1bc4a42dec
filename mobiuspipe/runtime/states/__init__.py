"""Where a stage's states live: all in host memory (HostStates: an optimizer over a flat fp32 parameter);
the fp32 master and moments in the rank's SSD store (SsdStates: OutOfCoreAdam through a fixed host budget);
or those and the device-dtype weights and gradients too (SsdStreamStates). Each loads the weights into the
arena, takes the offloaded gradients, steps, and writes the next device weights (bf16/fp16, or fp32) in
the same pass; all give the same bits (the same AdamW kernel, elementwise). Or all on the gpu (DeviceStates: LoRA's
adapters). A stage's frozen weights are mobiuspipe.runtime.frozen's.
"""

from __future__ import annotations

from mobiuspipe.runtime.states.device import DeviceStates, one_version
from mobiuspipe.runtime.states.host import HostStates
from mobiuspipe.runtime.states.ooc import SsdTier, least_share
from mobiuspipe.runtime.states.ssd import SsdStates
from mobiuspipe.runtime.states.stream import SsdStreamStates

StageStates = HostStates | DeviceStates | SsdStates | SsdStreamStates

__all__ = [
    "DeviceStates",
    "HostStates",
    "SsdStates",
    "SsdStreamStates",
    "SsdTier",
    "StageStates",
    "least_share",
    "one_version",
]
