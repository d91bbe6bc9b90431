"""Parquet column encodings per table: the columns an upsert looks keys up by are delta-encoded.

PyIceberg 0.12 writes every column dictionary-encoded, falling back to PLAIN once the dictionary
is full. For base.<table>'s key column (sorted within a file) and its ordering columns
(`_event_time`, `_source_seq`) that is the slow case: the upsert reads exactly these columns of
every candidate file to find the old versions of the changed keys, and decoding them was most of
an upsert's time on a large table (10M rows: about 10x slower than DELTA_BINARY_PACKED, which
also makes the files smaller).

A table lists the columns in its `partfin.write.parquet.delta-columns` property (base.<table>
gets it at creation); the Parquet format model installed here in PyIceberg's FileFormatFactory
(its registry of file formats, which refuses a second Parquet model: hence the replacement)
writes those columns DELTA_BINARY_PACKED (integer and timestamp columns only; others keep the
default) in every write of this process to that table; a table without the property is written
exactly as PyIceberg writes it.
Any other writer (Spark, Trino, plain PyIceberg) may ignore the property: readers do not care.
"""

from __future__ import annotations

import pyarrow as pa
from pyiceberg.io.fileformat import FileFormatFactory
from pyiceberg.io.pyarrow import ParquetFormatModel, ParquetFormatWriter
from pyiceberg.manifest import FileFormat
from pyiceberg.typedef import Properties

from partfin_assets.model import summary_keys as K

DELTA = "DELTA_BINARY_PACKED"


def delta_columns(properties: Properties) -> list[str]:
    """The columns a table asks to be delta-encoded."""
    return [c.strip() for c in properties.get(K.PROP_DELTA_COLUMNS, "").split(",") if c.strip()]


def writer_options(schema: pa.Schema, properties: Properties) -> dict:
    """pyarrow ParquetWriter options that delta-encode the table's delta columns (empty: PyIceberg's defaults)."""
    wanted = set(delta_columns(properties))
    delta = [
        f.name for f in schema
        if f.name in wanted and (pa.types.is_integer(f.type) or pa.types.is_timestamp(f.type))
    ]
    if not delta:
        return {}
    # pyarrow takes per-column encodings only with per-column dictionaries: every other leaf keeps one
    dictionary = [path for f in schema if f.name not in delta for path in _leaf_paths(f.name, f.type)]
    return {"use_dictionary": dictionary, "column_encoding": dict.fromkeys(delta, DELTA)}


def _leaf_paths(path: str, data_type: pa.DataType) -> list[str]:
    if pa.types.is_struct(data_type):
        return [p for i in range(data_type.num_fields) for p in _leaf_paths(f"{path}.{data_type.field(i).name}", data_type.field(i).type)]
    if pa.types.is_map(data_type):
        return _leaf_paths(f"{path}.key_value.key", data_type.key_type) + _leaf_paths(f"{path}.key_value.value", data_type.item_type)
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        return _leaf_paths(f"{path}.list.{data_type.value_field.name}", data_type.value_type)
    return [path]


class _Writer(ParquetFormatWriter):
    def write(self, table: pa.Table) -> None:
        if self._writer is None:  # options are fixed when the file is opened, from its first table's schema
            self._parquet_writer_kwargs = {**self._parquet_writer_kwargs, **writer_options(table.schema, self._properties)}
        super().write(table)


class _Model(ParquetFormatModel):
    def create_writer(self, output_file, file_schema, properties) -> ParquetFormatWriter:
        return _Writer(output_file, file_schema, properties)


def install_delta_encoding() -> None:
    """Make PyIceberg's Parquet writes in this process honor `partfin.write.parquet.delta-columns`."""
    registered = FileFormatFactory.get(FileFormat.PARQUET)
    if isinstance(registered, _Model):
        return
    if type(registered) is not ParquetFormatModel:
        raise RuntimeError(f"another Parquet writer is installed in PyIceberg: {type(registered).__name__}")
    FileFormatFactory._registry[FileFormat.PARQUET] = _Model()


install_delta_encoding()
