"""The named sharding presets, as `zoo.Preset` objects.

`zoo.preset(name)` looks one up by name; `zoo.rules(preset, **overrides)` copies its layout
into an editable dict; `zoo.TrainStep(..., preset=preset)` takes its step options.
"""

from ._presets import DP as DP
from ._presets import EP as EP
from ._presets import EP_FSDP as EP_FSDP
from ._presets import FSDP as FSDP
from ._presets import FSDP_ONCE as FSDP_ONCE
from ._presets import FSDP_TP as FSDP_TP
from ._presets import PRESETS as PRESETS
from ._presets import TP as TP
from ._presets import ZERO1 as ZERO1
from ._presets import Preset as Preset
