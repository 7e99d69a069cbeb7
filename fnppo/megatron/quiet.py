"""The one list of third-party warnings that fnppo silences, installed when ``fnppo`` is imported.

Each entry is a warning that megatron-core or torch prints on every run of a correct fnppo
program and that asks nothing of the user:

* megatron-core reports, once per module, that Apex and Transformer Engine are missing and that it
  falls back to torch implementations (norms, optimizers, multi-tensor kernels). On a CPU machine
  that is the only possible configuration; on a GPU it is the documented local layer spec.
* megatron-core's distributed optimizer reads ``.grad`` of its fp32 shard views to zero them; on
  CPU that access passes through :func:`fnppo.megatron.runtime.megatron_on_cpu`'s torch-function
  mode, so torch's "non-leaf ``.grad``" warning is attributed to ``fnppo.megatron.runtime``; on a GPU the same
  warning is attributed to ``megatron.core.optimizer``.
* torch marks ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` as deprecated; megatron-core
  0.16.1 calls them inside its distributed optimizer.

Nothing else is filtered: a warning raised by fnppo's own code is a bug (``tests/test_quiet.py``
runs the toy job and fails on any warning line). Set ``FNPPO_SHOW_WARNINGS=1`` to see them all.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["HARMLESS_WARNINGS", "install_warning_filters"]

#: ``(category, message regex, module regex)`` per harmless warning (see the module docstring).
HARMLESS_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core"),
    (UserWarning, r"Transformer Engine and Apex are not installed\. Falling back", r"megatron\.core"),
    (UserWarning, r"Transformer Engine and Apex are not installed\. Falling back", r"megatron_fsdp"),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor", r"fnppo\.megatron\.runtime"),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor", r"megatron\.core\.optimizer"),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated", r"torch\.distributed"),
    (FutureWarning, r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", r"torch\.distributed"),
)


def install_warning_filters() -> bool:
    """Add an ``ignore`` filter for each entry of :data:`HARMLESS_WARNINGS`.

    Returns False (and installs nothing) when ``FNPPO_SHOW_WARNINGS`` is set to a true value.
    """
    if os.environ.get("FNPPO_SHOW_WARNINGS", "0").strip().lower() not in ("", "0", "false", "off", "no"):
        return False
    for category, message, module in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    return True
