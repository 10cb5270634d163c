"""Dispatch: running steps as local or Slurm jobs (submitit), arrays, requeues, re-attachment, leases."""
