"""Low-level pieces of the training step, for building your own (like `equinox.internal`).

The everyday path needs none of these: `zoo.TrainStep` applies them. They are the
filtered transforms between plain, reduced and unreduced leaves (explicit mode:
`reduced_cast` → `unreduced_zeros` → `reduce_unreduced`; `jax.shard_map` mode:
`manual_specs`, `pcast_varying`, `pcast_unreduced`), the FSDP gather (`gather_over`), the
ZeRO layout (`split_spec`), the batch split (`check_batch`, `split_microbatches`), one
array's `PartitionSpec` under rules (`spec_for`) and the trainable/frozen split
(`partition_trainable`). See docs/design.md for how the step uses them.
"""

from ._batch import check_batch as check_batch
from ._batch import split_microbatches as split_microbatches
from ._reduced import gather_over as gather_over
from ._reduced import manual_specs as manual_specs
from ._reduced import pcast_unreduced as pcast_unreduced
from ._reduced import pcast_varying as pcast_varying
from ._reduced import plain_spec as plain_spec
from ._reduced import reduce_unreduced as reduce_unreduced
from ._reduced import reduced_cast as reduced_cast
from ._reduced import reshard_tree as reshard_tree
from ._reduced import split_spec as split_spec
from ._reduced import unreduced_zeros as unreduced_zeros
from ._rules import spec_for as spec_for
from ._step import partition_trainable as partition_trainable
