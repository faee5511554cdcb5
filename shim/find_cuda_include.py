"""Print the directory holding cuda.h from the nvidia-cuda-runtime-cu12 wheel (for the Makefile)."""

import importlib.util
import pathlib
import sys

spec = importlib.util.find_spec("nvidia")
paths = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
for base in paths:
    include = pathlib.Path(base) / "cuda_runtime" / "include"
    if (include / "cuda.h").is_file():
        print(include)
        sys.exit(0)
sys.exit("cuda.h not found: pip install nvidia-cuda-runtime-cu12 (or pass CUDA_INCLUDE=DIR)")
