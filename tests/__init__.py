"""refengine's tests, in folders that mirror the package (docs/testing.md)."""
