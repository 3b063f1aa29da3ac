"""What a run leaves behind: the library's (`zoo.internal`), named here for the commands."""

from __future__ import annotations

from ..internal import Metrics as Metrics
from ..internal import human_bytes as human_bytes
from ..internal import plot_losses as plot_losses
from ..internal import read_metrics as read_metrics
from ..internal import write_json as write_json
