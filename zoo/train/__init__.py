"""Training as a library: typed run configs, the `Trainer` and its hooks, and `run`.

- `zoo.train.run(RunConfig(...))`: a whole run as `zoo train` does it (build the model and
  its data, train, evaluate, checkpoint, save, summarise).
- `Trainer(step, batch_at, steps=..., hooks=[...])`: the loop alone, over your own
  `zoo.TrainStep` and batches, with hooks every N steps (`Evaluate`, `Checkpoint`,
  `MetricsLog`, `TensorBoard`, `Progress`, `Sample`, or your own `Hook`).
- `OptimizerConfig`: an optax optimizer with its learning-rate schedule.

docs/training.md tells the whole story.
"""

from ._config import DataConfig as DataConfig
from ._config import RunConfig as RunConfig
from ._errors import ConfigError as ConfigError
from ._errors import Preempted as Preempted
from ._errors import RunStopped as RunStopped
from ._evaluate import Evaluator as Evaluator
from ._hooks import Checkpoint as Checkpoint
from ._hooks import Evaluate as Evaluate
from ._hooks import Hook as Hook
from ._hooks import MetricsLog as MetricsLog
from ._hooks import Progress as Progress
from ._hooks import Sample as Sample
from ._hooks import TensorBoard as TensorBoard
from ._hooks import TrainState as TrainState
from ._optimizer import OPTIMIZERS as OPTIMIZERS
from ._optimizer import SCHEDULES as SCHEDULES
from ._optimizer import OptimizerConfig as OptimizerConfig
from ._run import RunResult as RunResult
from ._run import run as run
from ._trainer import Trainer as Trainer

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "Checkpoint",
    "ConfigError",
    "DataConfig",
    "Evaluate",
    "Evaluator",
    "Hook",
    "MetricsLog",
    "OptimizerConfig",
    "Preempted",
    "Progress",
    "RunConfig",
    "RunResult",
    "RunStopped",
    "Sample",
    "TensorBoard",
    "TrainState",
    "Trainer",
    "run",
]
