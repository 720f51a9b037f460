"""The training side: the GRPO trainer (:mod:`pearl_hpc.train.grpo`) and the weight sync
to rollout workers (:mod:`pearl_hpc.weights`).

Both import torch (and the trainer transformers) at module level, so this package does not
import them: ``import pearl_hpc.train`` stays cheap for the control plane.
"""
