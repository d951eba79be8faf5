"""Autograd layer: ties the kernels' forward and backward together (ops < autograd < api)."""
