"""The package as shipped: its import structure, the wheel, the README's commands."""
