"""K2 over several processes and nodes: a pipeline of whole-block stages on torch.distributed (one torchrun rank
per device), with probes, hooks and decoding working as on one process. docs/multinode.md is the guide."""

from .pipeline import PipelinedK2, init, stage_map

__all__ = ["PipelinedK2", "init", "stage_map"]
