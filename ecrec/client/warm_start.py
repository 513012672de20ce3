"""A warm start's rows: pretrained values for a new table, from a tensor, an array or a file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch


def load_values(source, spec) -> np.ndarray:
    """A warm start's rows for table ``spec``: a tensor or array ``(num_rows, dim)``, or the path of a ``.npy``
    file (memory-mapped: read a push at a time) or of a ``.pt`` file holding one tensor (or a state dict with
    one ``weight``)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"table {spec.name!r}: warm-start file {str(path)!r} does not exist")
        if path.suffix == ".npy":
            try:
                values = np.load(path, mmap_mode="r")
            except ValueError as exc:
                raise ValueError(f"table {spec.name!r}: {str(path)!r} is not a readable .npy file: {exc}") from None
        else:
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - reported with the file's name
                raise ValueError(f"table {spec.name!r}: {str(path)!r} is not a .npy or torch file: {exc}") from None
            if isinstance(loaded, dict):
                weights = [v for k, v in loaded.items() if k == "weight" or k.endswith(".weight")]
                if len(weights) != 1:
                    raise ValueError(f"table {spec.name!r}: {str(path)!r} holds {len(weights)} weights; "
                                     "give a file with one tensor")
                loaded = weights[0]
            values = loaded
        where = f"{str(path)!r}"
    else:
        values, where = source, "the values given"
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().to(torch.float32).numpy()
    else:  # rows given as nested lists too
        from ecrec.client.rows import list_as_array

        values = list_as_array(values, f"table {spec.name!r}: {where}")
    if not hasattr(values, "shape") or tuple(values.shape) != (spec.num_rows, spec.dim):
        raise ValueError(f"table {spec.name!r}: {where} must have shape {(spec.num_rows, spec.dim)}, got "
                         f"{tuple(getattr(values, 'shape', ()))}")
    return values
