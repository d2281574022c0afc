"""The profiler: what each container really did on its GPU, from NVML samples mapped to containers."""
