"""Image tables in the on-disk form Delta on Databricks writes, built by hand (delta-rs writes
neither deletion vectors nor column mapping), with the same log actions and file formats as the
Delta kernel's own test tables in tests/fixtures/delta/.

    python databricks_delta.py SOURCE.parquet OUT_DIR

writes into OUT_DIR, from the rows (`content`, `label`, `path`) of SOURCE.parquet:
- dv/: version 0 adds two part files; version 1 is a DELETE that re-adds both with deletion
  vectors: the first file's on disk (`deletion_vector_<uuid>.bin`: version byte, big-endian size,
  portable RoaringTreemap with its magic, CRC-32; descriptor `u` + z85 UUID, offset 1), the
  second's inline (`i` + z85 of the bitmap).
- cm-name/ and cm-id/: column mapping in `name` and `id` mode: the Parquet files hold physical
  column names `col-<uuid>` (and field ids in `id` mode) while the log's schema says `content`,
  `label` and `path`, and the label column was renamed to `class` (its logical name).

and prints JSON: {"dv": [kept paths, sorted], "rows": total rows}.
"""

import json
import os
import struct
import sys
import uuid
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
from pyroaring import BitMap

Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
PORTABLE_MAGIC = 1681511377
NOW = 1764921600000


def z85(data: bytes) -> str:
    assert len(data) % 4 == 0
    out = []
    for i in range(0, len(data), 4):
        v = int.from_bytes(data[i : i + 4], "big")
        chunk = ""
        for _ in range(5):
            chunk = Z85[v % 85] + chunk
            v //= 85
        out.append(chunk)
    return "".join(out)


def treemap(rows) -> bytes:
    """A RoaringTreemap (64-bit) of row indexes in the portable form, behind its magic number."""
    return (
        struct.pack("<I", PORTABLE_MAGIC)
        + struct.pack("<Q", 1)
        + struct.pack("<I", 0)
        + BitMap(rows).serialize()
    )


def stats(n: int) -> str:
    return json.dumps({"numRecords": n, "tightBounds": False})


def log(table: str, version: int, actions) -> None:
    os.makedirs(f"{table}/_delta_log", exist_ok=True)
    with open(f"{table}/_delta_log/{version:020d}.json", "w") as f:
        f.write("".join(json.dumps(a) + "\n" for a in actions))


def field(name, type_, meta=None):
    return {"name": name, "type": type_, "nullable": True, "metadata": meta or {}}


def metadata(fields, configuration) -> dict:
    return {
        "metaData": {
            "id": str(uuid.uuid4()),
            "format": {"provider": "parquet", "options": {}},
            "schemaString": json.dumps({"type": "struct", "fields": fields}),
            "partitionColumns": [],
            "configuration": configuration,
            "createdTime": NOW,
        }
    }


def add(table, name, n, dv=None) -> dict:
    a = {
        "path": name,
        "partitionValues": {},
        "size": os.path.getsize(f"{table}/{name}"),
        "modificationTime": NOW,
        "dataChange": True,
        "stats": stats(n),
    }
    if dv:
        a["deletionVector"] = dv
    return {"add": a}


def deletion_vectors(src: pa.Table, table: str) -> list:
    os.makedirs(table)
    half = src.num_rows // 2
    parts = [src.slice(0, half), src.slice(half)]
    names = [f"part-0000{i}-{uuid.uuid4()}-c000.snappy.parquet" for i in range(2)]
    for part, name in zip(parts, names):
        pq.write_table(part, f"{table}/{name}", compression="snappy")
    protocol = {
        "protocol": {
            "minReaderVersion": 3,
            "minWriterVersion": 7,
            "readerFeatures": ["deletionVectors"],
            "writerFeatures": ["deletionVectors"],
        }
    }
    fields = [field("path", "string"), field("content", "binary"), field("label", "string")]
    conf = {"delta.enableDeletionVectors": "true"}
    log(table, 0, [protocol, metadata(fields, conf)] + [add(table, n, p.num_rows) for n, p in zip(names, parts)])

    # Every 7th row of the first file and every 5th of the second are deleted.
    gone = [list(range(0, parts[0].num_rows, 7)), list(range(3, parts[1].num_rows, 5))]
    on_disk = treemap(gone[0])
    dv_id = uuid.uuid4()
    with open(f"{table}/deletion_vector_{dv_id}.bin", "wb") as f:
        f.write(b"\x01" + struct.pack(">I", len(on_disk)) + on_disk + struct.pack(">I", zlib.crc32(on_disk)))
    inline = treemap(gone[1])
    padded = inline + b"\x00" * (-len(inline) % 4)
    dvs = [
        {"storageType": "u", "pathOrInlineDv": z85(dv_id.bytes), "offset": 1,
         "sizeInBytes": len(on_disk), "cardinality": len(gone[0])},
        {"storageType": "i", "pathOrInlineDv": z85(padded), "sizeInBytes": len(inline),
         "cardinality": len(gone[1])},
    ]
    actions = [{"commitInfo": {"timestamp": NOW + 1, "operation": "DELETE", "engineInfo": "Databricks-Runtime/<unknown>"}}]
    for name, part, dv in zip(names, parts, dvs):
        actions.append({"remove": {"path": name, "deletionTimestamp": NOW + 1, "dataChange": True,
                                   "extendedFileMetadata": True, "partitionValues": {},
                                   "size": os.path.getsize(f"{table}/{name}")}})
        actions.append(add(table, name, part.num_rows, dv))
    log(table, 1, actions)
    kept = []
    for part, g in zip(parts, gone):
        paths = part.column("path").to_pylist()
        kept += [p for i, p in enumerate(paths) if i not in set(g)]
    return sorted(kept)


def column_mapping(src: pa.Table, table: str, mode: str) -> None:
    os.makedirs(table)
    logical = [("path", "string", pa.string()), ("content", "binary", pa.binary()),
               ("class", "string", pa.string())]
    source_columns = ["path", "content", "label"]
    physical = [f"col-{uuid.uuid4()}" for _ in logical]
    arrays = [src.column(c) for c in source_columns]
    pa_fields = [
        pa.field(p, t, metadata={b"PARQUET:field_id": str(i + 1).encode()} if mode == "id" else None)
        for i, (p, (_, _, t)) in enumerate(zip(physical, logical))
    ]
    name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    pq.write_table(pa.Table.from_arrays(arrays, schema=pa.schema(pa_fields)), f"{table}/{name}")
    fields = [
        field(n, t, {"delta.columnMapping.id": i + 1, "delta.columnMapping.physicalName": p})
        for i, ((n, t, _), p) in enumerate(zip(logical, physical))
    ]
    protocol = {
        "protocol": {
            "minReaderVersion": 3,
            "minWriterVersion": 7,
            "readerFeatures": ["columnMapping"],
            "writerFeatures": ["columnMapping"],
        }
    }
    conf = {"delta.columnMapping.mode": mode, "delta.columnMapping.maxColumnId": str(len(fields))}
    log(table, 0, [protocol, metadata(fields, conf), add(table, name, src.num_rows)])


def main() -> None:
    src, out = sys.argv[1], sys.argv[2]
    t = pq.read_table(src, columns=["path", "content", "label"])
    kept = deletion_vectors(t, f"{out}/dv")
    for mode in ["name", "id"]:
        column_mapping(t, f"{out}/cm-{mode}", mode)
    print(json.dumps({"dv": kept, "rows": t.num_rows}))


if __name__ == "__main__":
    main()
