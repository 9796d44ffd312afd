"""Shared JSON data types: ModelInput and its chunks, TensorData, LoRA / optimizer config."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import Discriminator, Field, Tag, model_validator

from openrl.errors import UserError

from ._base import FieldError, WireModel

__all__ = [
    "EncodedTextChunk",
    "ImageChunk",
    "ImageAssetPointerChunk",
    "DmelChunk",
    "ModelInputChunk",
    "ModelInput",
    "TensorData",
    "LoraConfig",
    "AdamwConfig",
    "DimuonConfig",
    "OptimizerConfig",
    "Finite",
    "NonNegInt",
    "PosInt",
]

Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]


class EncodedTextChunk(WireModel):
    """``{type: "encoded_text", tokens: [int]}``; token ids ≥ 0."""

    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[NonNegInt]


class ImageChunk(WireModel):
    """``{type: "image", data: base64, format, expected_tokens?}`` (not supported; kept raw)."""

    type: Literal["image"] = "image"
    data: str
    format: str
    expected_tokens: int | None = None


class ImageAssetPointerChunk(WireModel):
    """``{type: "image_asset_pointer", location, format, expected_tokens?}`` (not supported)."""

    type: Literal["image_asset_pointer"] = "image_asset_pointer"
    location: str
    format: str
    expected_tokens: int | None = None


class DmelChunk(WireModel):
    """``{type: "dmel", dmel: base64}`` (audio; not supported)."""

    type: Literal["dmel"] = "dmel"
    dmel: str


def _chunk_tag(v: Any) -> str | None:
    if isinstance(v, dict):
        t = v.get("type")
        if t is not None:
            return t
        for key, tag in (("tokens", "encoded_text"), ("location", "image_asset_pointer"),
                         ("data", "image"), ("dmel", "dmel")):
            if key in v:
                return tag
        return "encoded_text"
    return getattr(v, "type", None)


ModelInputChunk = Annotated[
    Union[
        Annotated[EncodedTextChunk, Tag("encoded_text")],
        Annotated[ImageChunk, Tag("image")],
        Annotated[ImageAssetPointerChunk, Tag("image_asset_pointer")],
        Annotated[DmelChunk, Tag("dmel")],
    ],
    Discriminator(_chunk_tag),
]
"""A chunk, discriminated by ``type`` (inferred from its keys when ``type`` is absent)."""


class ModelInput(WireModel):
    """``{chunks: [chunk]}``."""

    chunks: list[ModelInputChunk] = []

    def to_tokens(self, field: str = "prompt") -> list[int]:
        """All ``encoded_text`` tokens concatenated.

        Raises:
            UserError: ``<field>.chunks[j]`` for an image / image_asset_pointer / dmel chunk.
        """
        out: list[int] = []
        for j, c in enumerate(self.chunks):
            if not isinstance(c, EncodedTextChunk):
                what = "audio (dmel)" if isinstance(c, DmelChunk) else "image"
                raise UserError(f"{field}.chunks[{j}]", f"{what} chunks are not supported by this server")
            out.extend(c.tokens)
        return out


class TensorData(WireModel):
    """JSON tensor: ``{data: [number] (flattened), dtype, shape?, sparse_crow_indices?,
    sparse_col_indices?}``. In CSR form ``data`` holds the listed values only and
    ``shape`` is the dense 2-D shape."""

    data: list[float]
    dtype: Literal["int64", "float32"]
    shape: list[NonNegInt] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    @model_validator(mode="after")
    def _check(self) -> "TensorData":
        if (self.sparse_crow_indices is None) != (self.sparse_col_indices is None):
            raise FieldError("sparse_col_indices", "sparse_crow_indices and sparse_col_indices go together")
        if self.sparse_crow_indices is not None and (self.shape is None or len(self.shape) != 2):
            raise FieldError("shape", "a sparse CSR tensor needs a 2-D shape")
        if self.dtype == "int64" and any(x != int(x) for x in self.data if np.isfinite(x)):
            raise FieldError("data", "int64 tensor holds non-integer values")
        return self

    def to_numpy(self, pad_value: float = 0, field: str = "tensor") -> np.ndarray:
        """Dense array: int64 or float32 per ``dtype``, shaped by ``shape`` (1-D if absent).

        Args:
            pad_value: value of cells a CSR tensor does not list (0 for loss inputs,
                -1 for ``target_prompt_logprobs``).
            field: the request field, named in errors.

        Raises:
            UserError: element count not matching ``shape``; inconsistent CSR indices.
        """
        from openrl.edge.proto import csr_to_dense

        np_dtype = np.int64 if self.dtype == "int64" else np.float32
        values = np.asarray(self.data, dtype=np.float64).astype(np_dtype)
        if self.sparse_crow_indices is not None:
            return csr_to_dense(values, np.asarray(self.sparse_crow_indices), np.asarray(self.sparse_col_indices),
                                self.shape or [], pad_value, field_name=field)
        shape = self.shape if self.shape is not None else [len(values)]
        n = int(np.prod(shape)) if shape else 1
        if n != len(values):
            raise UserError(field, f"data has {len(values)} elements but shape {shape} needs {n}")
        return values.reshape(shape)


class LoraConfig(WireModel):
    """``{rank, seed?, train_unembed=True, train_mlp=True, train_attn=True}``."""

    rank: PosInt
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class AdamwConfig(WireModel):
    """``{type: "adamw"}``: AdamW, the default optimizer."""

    type: Literal["adamw"] = "adamw"


class DimuonConfig(WireModel):
    """``{type: "dimuon", version: 1}``."""

    type: Literal["dimuon"] = "dimuon"
    version: Literal[1] = 1


def _optimizer_tag(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("type", "adamw")
    return getattr(v, "type", None)


OptimizerConfig = Annotated[
    Union[Annotated[AdamwConfig, Tag("adamw")], Annotated[DimuonConfig, Tag("dimuon")]],
    Discriminator(_optimizer_tag),
]
"""Optimizer chosen at model creation, by ``type`` (absent → adamw)."""
