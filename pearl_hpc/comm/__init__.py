"""Communication: the MPI control plane and the torch.distributed data plane."""
