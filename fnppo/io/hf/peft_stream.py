"""A LoRA run's adapters handed to an inference engine per step, in PEFT's layout, instead of merged
weights (:func:`stream_peft_adapter`): engines that serve adapters (vLLM's LoRA requests, SGLang's
``load_lora_adapter``, ``peft.set_peft_model_state_dict``) take PEFT's tensor names and its
``adapter_config.json``.

Built on the PEFT save path itself (:func:`fnppo.io.hf.peft.save_peft_adapter`, dense and MoE expert
adapters alike): the adapter is written to a private temporary directory (host memory where
``tmp_dir`` is a RAM file system such as ``/dev/shm``), read back and removed, so the tensors and the
config are exactly those of the saved adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from fnppo.core.errors import input_error
from fnppo.core.typing import Tensor
from fnppo.io.hf.peft import CONFIG_FILE, WEIGHTS_FILE, save_peft_adapter
from fnppo.megatron.parallel import current_layout

__all__ = ["stream_peft_adapter"]


def stream_peft_adapter(
    model_chunks: Sequence[nn.Module],
    *,
    base_model_name_or_path: str | None = None,
    tmp_dir: str | os.PathLike | None = None,
) -> tuple[dict[str, Any] | None, list[tuple[str, Tensor]]]:
    """The model's LoRA adapters as PEFT names them, on rank 0: ``(adapter_config, [(name, tensor), ...])``.

    Collective over the whole world (call on every rank; the adapters are gathered as full tensors as
    :func:`~fnppo.io.hf.peft.save_peft_adapter` gathers them). On rank 0: the ``adapter_config.json``
    dict (``r``, ``lora_alpha``, ``target_modules``, ``target_parameters`` and the
    ``rank_pattern`` / ``alpha_pattern`` of fused experts) and the tensors of
    ``adapter_model.safetensors`` sorted by name (``base_model.model.<module>.lora_A.weight`` ``[r,
    in]``, ``...lora_B.weight`` ``[out, r]``; experts in PEFT's ``target_parameters`` form); on the
    other ranks ``(None, [])``. ``peft.set_peft_model_state_dict(peft_model, dict(tensors))`` on a
    ``PeftModel`` built with ``LoraConfig(**config)`` then computes what the fnppo model computes.

    ``tmp_dir``: where rank 0 writes and removes the adapter (default: the system's temporary
    directory).

    Raises:
        InputError: ``tmp_dir`` not an existing directory; everything ``save_peft_adapter`` refuses
            (a model without adapters, ...).
        CheckpointError: rank 0 could not write the temporary files (on every rank).
    """
    fn = "fnppo.hf.stream_peft_adapter"
    if tmp_dir is not None and not (isinstance(tmp_dir, (str, os.PathLike)) and Path(tmp_dir).is_dir()):
        raise input_error(fn, "tmp_dir", "None or an existing directory", repr(tmp_dir))
    rank0 = current_layout().rank == 0
    where = [tempfile.mkdtemp(prefix="fnppo-adapter-", dir=tmp_dir) if rank0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(where, src=0)
    path = Path(where[0])
    try:
        save_peft_adapter(model_chunks, path, base_model_name_or_path=base_model_name_or_path)
        if not rank0:
            return None, []
        from safetensors.torch import load_file

        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(path / WEIGHTS_FILE))
        return config, sorted(tensors.items())
    finally:
        if rank0:
            shutil.rmtree(path, ignore_errors=True)
