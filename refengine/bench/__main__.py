"""``python -m refengine.bench``: the same commands as ``refengine bench``."""

from refengine.bench.cli import bench

bench()
