"""Parallelism: degrees, their config, the functions that apply them, and the Lightning strategy."""

from disttrain.parallel.config import DDPOptions, ParallelConfig
from disttrain.parallel.dims import MESH_DIM_NAMES, ParallelDims

__all__ = ["DDPOptions", "MESH_DIM_NAMES", "ParallelConfig", "ParallelDims"]
