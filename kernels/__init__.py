"""CUDA C sources of ds4ref's CuPy backend. Installed as ds4ref.kernels (package data)."""
