#!/usr/bin/env python3
"""Read a spool shard the way downstream users do, and check it against schemas/.

Usage: read_shard.py SHARD.parquet schemas/shard.schema.json

Checks, with pyarrow (required): the Arrow schema equals the schema file exactly (column
names, pyarrow type strings, nullability, order), every column chunk is ZSTD, and every
required metadata key is present. With DuckDB (when importable): row count, sum of
completion_tokens, ids, token id lists and timestamps agree with pyarrow.

Prints one JSON object on stdout: {"rows": [...], "metadata": {...}, "row_groups": N,
"readers": ["pyarrow", "duckdb"?]}; timestamps are given as unix milliseconds. Exits 1
with a message on stderr on any mismatch, 2 when pyarrow is missing.
"""

import json
import sys


def fail(message, code=1):
    print(f"read_shard.py: {message}", file=sys.stderr)
    sys.exit(code)


def main():
    if len(sys.argv) != 3:
        fail("usage: read_shard.py SHARD.parquet SCHEMA.json", 2)
    path, schema_path = sys.argv[1], sys.argv[2]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        fail(f"pyarrow is not importable ({e}); install it: pip install pyarrow duckdb", 2)

    with open(schema_path, encoding="utf-8") as f:
        spec = json.load(f)

    pf = pq.ParquetFile(path)
    schema = pf.schema_arrow
    expected = [(c["name"], c["type"], c["nullable"]) for c in spec["columns"]]
    found = [(fld.name, str(fld.type), fld.nullable) for fld in schema]
    if found != expected:
        diffs = [f"  column {i}: file {f!r}, schema file {e!r}"
                 for i, (f, e) in enumerate(zip(found, expected)) if f != e]
        if len(found) != len(expected):
            diffs.append(f"  file has {len(found)} columns, schema file {len(expected)}")
        fail("schema differs from the schema file:\n" + "\n".join(diffs))

    md = pf.metadata
    for rg in range(md.num_row_groups):
        for col in range(md.num_columns):
            chunk = md.row_group(rg).column(col)
            if chunk.compression != "ZSTD":
                fail(f"row group {rg} column {chunk.path_in_schema}: codec {chunk.compression}, expected ZSTD")

    metadata = {k.decode(): v.decode() for k, v in (md.metadata or {}).items()
                if k != b"ARROW:schema"}
    for key in spec["metadata_keys"]:
        if key["required"] and key["key"] not in metadata:
            fail(f"required metadata key {key['key']!r} missing; have {sorted(metadata)}")

    table = pq.read_table(path)
    if table.schema.remove_metadata() != schema.remove_metadata():
        fail(f"read_table schema {table.schema} differs from the file schema {schema}")
    columns = {}
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.int64())
        columns[name] = col.to_pylist()
    rows = [{name: columns[name][i] for name in table.column_names} for i in range(table.num_rows)]
    readers = ["pyarrow"]

    try:
        import duckdb
    except ImportError:
        duckdb = None
    if duckdb is not None:
        con = duckdb.connect()
        count, total = con.execute(
            "SELECT count(*), sum(completion_tokens) FROM read_parquet(?)", [path]).fetchone()
        want_total = sum(r["completion_tokens"] for r in rows) if rows else None
        if count != len(rows) or total != want_total:
            fail(f"duckdb: count {count}, sum(completion_tokens) {total}; "
                 f"pyarrow: {len(rows)}, {want_total}")
        got = con.execute(
            "SELECT id, \"row\", prompt_token_ids, completion_token_ids, ttft_ms, "
            "epoch_ms(completed_at) FROM read_parquet(?)", [path]).fetchall()
        want = [(r["id"], r["row"], r["prompt_token_ids"], r["completion_token_ids"],
                 r["ttft_ms"], r["completed_at"]) for r in rows]
        if [tuple(g) for g in got] != want:
            fail(f"duckdb values differ from pyarrow:\n  duckdb  {got}\n  pyarrow {want}")
        readers.append("duckdb")

    json.dump({"rows": rows, "metadata": metadata, "row_groups": md.num_row_groups,
               "readers": readers}, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
