"""The speed rooms: every module of the model that exists only for speed, each equal to the reference computation it
replaces (to float32 rounding) and called from the reading path in one line. ``K2Model.speed = False`` (or ``with
model.reference():``) turns every one off. What each gains is measured by ``python -m benchmarks.vs_hf``
(docs/speed.md).

    linear.py            a decode step's few-row products split over the CPU's threads
    fused_attention.py   the naive path's attention through PyTorch's fused kernel (v padded to the q/k width on CPUs)
    grouped_experts.py   the chosen experts grouped: sorted, paired, or (indexed_experts.py) read by index
    indexed_experts.py   each slot's expert gathered by the routing tensor itself (compiled steps, GPUs)
    loss.py              the forward's loss; the head's cross-entropy a few rows at a time
    compiled_decode.py   generate(compile=True): the decode step as one torch.compile graph
    static_decode.py     ... over a static cache, for a CUDA graph
"""
