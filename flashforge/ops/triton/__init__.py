"""Triton kernels and their launchers (imported only where triton is installed)."""
