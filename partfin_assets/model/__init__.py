"""The bottom layer: partfin's record contract and pure values (records, keys, table declaration, summary keys, stats, time, errors). Imports no other partfin layer."""
