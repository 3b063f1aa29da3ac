"""What a run shows and leaves behind: the library's (`zoo.train._output`), named here for
the commands."""

from __future__ import annotations

from ..train._output import Metrics as Metrics
from ..train._output import Progress as Progress
from ..train._output import human_bytes as human_bytes
from ..train._output import plot_losses as plot_losses
from ..train._output import read_metrics as read_metrics
from ..train._output import write_json as write_json
