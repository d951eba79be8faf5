"""Gluon kernels: architecture-specific fast paths (Triton's lower-level language), used
where a call is in their scope; the portable Triton kernels serve everything else."""
