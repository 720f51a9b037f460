"""Weight transport between the trainer and the engines, below both (:mod:`pearl_hpc.train`
sends, :mod:`pearl_hpc.engine` receives):

    wire.py   a version as a header and bounded buckets (describe, pack, unpack)
    group.py  torch.distributed weight groups (gloo on CPU, NCCL on GPU): broadcast,
              point to point, received straight into a store
    shm.py    a version staged once per node in /dev/shm and mapped by the engines there
    leftovers.py  what this user's dead processes left in /dev/shm, swept (no torch)
"""
