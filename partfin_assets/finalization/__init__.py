"""Completeness read from table metadata: which hours are final, what each hour partition holds, late data, status."""
