"""grain data pipelines for veRL / ROLL formats: parquet, jsonl, json, csv; chat templates; truncation."""
