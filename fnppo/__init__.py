"""fnppo: functional, shape-checked PPO/GRPO training steps for Megatron-core models."""

from fnppo.parallel import ParallelLayout as ParallelLayout
from fnppo.parallel import current_layout as current_layout
from fnppo.parallel import init_parallel as init_parallel
from fnppo.typing import InputError as InputError
from fnppo.typing import ShapeError as ShapeError
from fnppo.typing import set_typechecking as set_typechecking
from fnppo.typing import typechecking as typechecking

__version__ = "0.1.0"
