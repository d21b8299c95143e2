"""GPU kernels in Triton. Each has a torch reference next to its test and runs on CPU under
Triton's interpreter (TRITON_INTERPRET=1), so CI tests them without a GPU (issue 24)."""
