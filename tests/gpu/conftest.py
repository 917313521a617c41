"""The GPU checks run compiled kernels: Triton's interpreter must stay off (run this directory on its own:
``pytest -m gpu tests/gpu``; the kernel tests' conftest turns the interpreter on for the CPU)."""
