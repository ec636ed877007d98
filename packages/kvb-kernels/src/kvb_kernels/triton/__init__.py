"""Triton kernels. Importing this subpackage requires Triton (``pip install "kvb-kernels[triton]"``)."""
