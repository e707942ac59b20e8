"""Runtime: assembling claimed kernels with the Inductor fallback, and CUDA-graph wrapping."""
