"""planekv.kernels: Triton decode kernels (encode/append, Key stage, Value allocation, Value stage),
dense and baseline kernels, and dispatch (GPU, or Triton's interpreter on CPU). Builds on kvstore."""
