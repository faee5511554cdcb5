"""The profiler: measurement sessions -> kernel profiles (FIKIT), with gap predictors."""
