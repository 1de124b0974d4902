# %% [markdown]
# # 08 · Scale: the real Kimi K2 by the numbers
#
# Everything in this notebook except the last section is computed from K2's configuration alone, with no weights:
# `k2lab.accounting` lists every tensor of the released checkpoint (name, shape, storage format) and counts from
# that one list.
#
# *Sources, and what they leave unsaid.* The counts below equal those derived from the released `config.json` and
# `modeling_deepseek.py` and read from the checkpoint's safetensors headers (FP8 block scales left out):
# 1,026,408,232,448 parameters in all, 497,500,160 in the dense block 0, 101,124,096 in one MLA (OpenModelAtlas's
# K2 architecture pages, which cite the config and code line by line). The K2 report gives rounder and slightly different figures:
# 1.04 T total and 32.6 B activated (its Table 2), "1 T and 32 B" in its abstract; it does not say what those figures
# include. Counting the released tensors gives 1,026.4 B and 32.9 B activated per token, embedding and head
# included (30.5 B without them). The bytes are the release's storage formats (`quantization_config` in the
# config: FP8 e4m3 with 128 × 128 blocks), not a claim about how K2 was trained.

# %%
import torch

import k2lab
from k2lab import K2Config, lab, viz
from k2lab.lab import exercises
from k2lab.analysis.accounting import attention_parameters, block_parameters

lab.setup_notebook()
k2 = K2Config.kimi_k2()
count = k2lab.count_parameters(k2)

# %% [markdown]
# ## Parameters
#
# A token uses the embedding, every attention, the dense first block, the shared experts, the router and 8 of the
# 384 routed experts of each MoE block: 32.9 billion of the 1,026 billion. The correction biases (60 × 384) are
# counted with the router, since the checkpoint stores them.

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'component':<16}{'total':>20}{'active per token':>20}")
for name, total, active in count.table():
    print(f"{name:<16}{total:>20,}{active:>20,}")
print(f"{'all':<16}{count.total:>20,}{count.active:>20,}")
print(f"\nactive without the embedding and the head: {count.active_without_embeddings:,} "
      f"({count.active / count.total:.1%} of all parameters are active)")
print(f"one MLA: {attention_parameters(k2):,}; the dense block 0: {block_parameters(k2, 0):,}; "
      f"one MoE block: {block_parameters(k2, 1):,}")

# %% [markdown]
# The figure shows the same table twice: on a log axis, where the small components can be read, and as shares on a
# linear axis, where it is plain that the routed experts are nearly all of the parameters (99%), and still about
# two thirds of those active per token, although a token runs only 8 of each layer's 384.

# %% tags=["nbval-ignore-output"]
viz.parameter_figure(count.table(),
                     title="Kimi K2: parameters by component, total against active per token")

# %% [markdown]
# ## Bytes
#
# The release stores every large matrix in FP8 ([e4m3](GLOSSARY.md#e4m3), one byte per value, with a float32 scale per 128 × 128
# block); the embedding, the head, the norms and the router stay in bfloat16, the correction bias in float32.

# %%
# NBVAL_CHECK_OUTPUT
GiB = 2**30
print(f"FP8 release:          {k2lab.weight_bytes(k2) / GiB:8.1f} GiB (block scales: "
      f"+{(k2lab.weight_bytes(k2, scales=True) - k2lab.weight_bytes(k2)) / GiB:.2f} GiB)")
print(f"bfloat16 everywhere:  {k2lab.weight_bytes(k2, format='unquantized') / GiB:8.1f} GiB")
for tokens in (4_096, 32_768, 131_072):
    print(f"KV cache, {tokens:>7,} tokens: {k2lab.kv_cache_bytes(k2, tokens) / GiB:5.2f} GiB latent, "
          f"{k2lab.kv_cache_bytes(k2, tokens, layout='expanded') / GiB:7.1f} GiB expanded")

# %% [markdown]
# ## Can this machine run K2?
#
# `k2lab.plan` places whole blocks on devices in order (the embedding on the first, the head on the last), keeps
# headroom on each for activations and the KV cache, and says whether it fits. It balances by bytes in one sense:
# it minimises the fullest device's weights, as a share of its capacity less the headroom; it does not make the
# devices equal. On this machine's memory alone:

# %% tags=["nbval-ignore-output"]
print(k2lab.plan(k2, devices=[torch.device("cpu")]))

# %% [markdown]
# On a node of eight 141 GB GPUs (H200), with the FP8 weights resident:

# %%
print(k2lab.plan(k2, devices=[141 * 10**9] * 8))

# %% [markdown]
# Why 136.5 GB on six devices and 87.7 GB on the last: one MoE block in FP8 is about 17.1 GB (136.5 / 8), and a
# device's 141 GB less the 4.3 GB of headroom holds eight of them but not nine. Sixty MoE blocks on eight devices
# put at least eight on one of them, so no placement of whole blocks gets the fullest device below 136.5 GB. The
# plan fills the devices in order up to that: cuda:0 takes the embedding, the dense block 0 and seven MoE blocks
# (122.3 GB), cuda:1 to cuda:6 eight MoE blocks each, and cuda:7 what is left: five MoE blocks, the final norm and
# the head (87.7 GB). An even split would put 128.6 GB (1,029.2 / 8) on each, which whole blocks cannot reach.

# %% [markdown]
# ## Three relatives side by side
#
# The same accounting for two relatives ([docs/family.md](../docs/family.md) lists the family and how each is
# tested):
#
# * **Kimi-K2-Thinking** (`K2Config.kimi_k2_thinking()`): K2-Instruct-0905's architecture, so the same parameters
#   as K2; its release stores the routed experts in INT4 (compressed-tensors `pack-quantized`: 4-bit integers in
#   groups of 32 with a bfloat16 scale per group, per its config.json's `quantization_config`;
#   `k2lab/weights/quant/int4.py`) and everything else in bfloat16;
# * **Moonlight-16B-A3B** (`K2Config.moonlight()`): Moonshot's small model of the same design (27 blocks of 2,048,
#   64 experts top-6 + 2 shared), released in bfloat16.
#
# Counts are `count_parameters` (exact against each release, tests/analysis/test_family_counts.py); bytes are
# `weight_bytes(cfg, format=..., scales=True)`, the stored bytes with the scales; the GPU counts are the fewest
# devices `k2lab.plan(cfg, devices=[capacity] * n, format=...)` fits, with its default headroom of 4 GiB per device
# for activations and the KV cache.

# %%
# NBVAL_CHECK_OUTPUT
import math

family = [("Kimi K2 (FP8)", K2Config.kimi_k2(), "fp8"),
          ("K2-Thinking (INT4 experts)", K2Config.kimi_k2_thinking(), "int4"),
          ("Moonlight (bfloat16)", K2Config.moonlight(), "unquantized")]


def gpus_needed(cfg: K2Config, fmt: str, capacity: int, stored: int) -> int:
    """The fewest devices of ``capacity`` bytes that plan fits, starting from the bytes alone (a lower bound)."""
    n = max(1, math.ceil(stored / capacity))
    while not k2lab.plan(cfg, devices=[capacity] * n, format=fmt).fits:
        n += 1
    return n


rows = []
for name, cfg, fmt in family:
    params = k2lab.count_parameters(cfg)
    stored = k2lab.weight_bytes(cfg, format=fmt, scales=True)
    rows.append((name, params.total / 1e9, params.active / 1e9, stored / 1e9,
                 *(gpus_needed(cfg, fmt, gb * 10**9, stored) for gb in (80, 141))))
print(f"{'model':<28}{'params':>10}{'active':>9}{'stored':>11}{'80 GB GPUs':>12}{'141 GB GPUs':>13}")
for name, total, active, stored, n80, n141 in rows:
    print(f"{name:<28}{total:>9,.1f}B{active:>8.2f}B{stored:>8,.1f} GB{n80:>12}{n141:>13}")

# %% tags=["nbval-ignore-output"]
import plotly.graph_objects as go

fig = go.Figure(go.Table(
    columnwidth=[2.2, 1, 1, 1, 1, 1],
    header=dict(values=["model", "parameters", "active per token", "stored weights", "80 GB GPUs", "141 GB GPUs"],
                height=30),
    cells=dict(height=26, values=[[r[0] for r in rows], [f"{r[1]:,.1f} B" for r in rows],
                                  [f"{r[2]:.2f} B" for r in rows], [f"{r[3]:,.1f} GB" for r in rows],
                                  [r[4] for r in rows], [r[5] for r in rows]])))
fig.update_layout(title="K2, K2-Thinking and Moonlight: parameters, bytes, GPUs (k2lab.plan)",
                  height=50 + 30 + 26 * len(rows) + 16, margin=dict(l=20, r=30, t=50, b=0))
fig

# %% [markdown]
# What the table says. K2 and K2-Thinking have the same 1,026 B parameters and 32.9 B active per token (active
# includes the embedding and head here), but INT4 experts take 0.5 byte per weight plus 2 bytes per 32 for the
# scales, against FP8's 1 byte, so K2-Thinking stores 594 GB against 1,029 GB ([docs/multinode.md](../docs/multinode.md)
# does the same arithmetic by hand). That is the difference between 15 and 9 GPUs of 80 GB, or 8 and 5 of 141 GB.
# Eight 80 GB GPUs (640 GB) would hold K2-Thinking's bytes, but not with 4 GiB of headroom on each and whole
# blocks per device: the plan needs a ninth. Moonlight, 64 times smaller, fits on one GPU of either size in
# bfloat16 (32 GB); its 2.91 B active per token include its 0.67 B embedding and head (docs/family.md gives 2.24 B
# without them).

# %% [markdown]
# Without such a node, two levers remain, both options of `k2lab.load`:
#
# * `expert_budget_bytes`: keep every weight but the routed experts resident and read each expert from its file
#   when a token first needs it, through an [LRU](GLOSSARY.md#lru) cache of that many bytes. The routed experts are 99% of K2's
#   weights, but a token uses 8 of 384 per block;
# * `num_layers`: load a prefix of the model (the first N blocks, then the final norm and head), a logit-lens
#   view of the real thing.
#
# On a CPU the loader dequantizes FP8 to bfloat16 once, so the resident part is planned in bfloat16:

# %% tags=["nbval-ignore-output"]
from k2lab.weights.load import slice_layers

budget = 4 * GiB
print(k2lab.plan(k2, devices=[torch.device("cpu")], format="unquantized", expert_budget_bytes=budget))
print()
print(k2lab.plan(slice_layers(k2, 4), devices=[torch.device("cpu")], format="unquantized",
                 expert_budget_bytes=budget))

# %% [markdown]
# ## A real-shape layer with streamed experts
#
# A true K2 MoE layer holds 17 GB of FP8 experts: writing one takes minutes and far more disk than a notebook
# should use. So here we build an **honestly reduced slice**: one MoE block at K2's true shapes (width 7,168, MLA
# at full size, experts of 2,048 hidden features, top-8 routing, the shared expert) but with **16 routed experts
# instead of 384** and **K2-nano's 8,192-token vocabulary instead of 163,840**, filled with random FP8 weights in
# the release layout. Every tensor that exists has its real size; there are just fewer of them. The full
# true-size layer (384 experts, the true vocabulary, ~22 GB) is benchmarked by
# `python -m benchmarks.real_shape_layer`.

# %%
import math
import tempfile
from pathlib import Path

from k2lab.weights.writer import write_checkpoint
from k2lab.weights.quant.fp8 import FP8, FP8_MAX, FP8Format, scale_shape

sliced = k2.replace(num_hidden_layers=1, first_k_dense_replace=0, n_routed_experts=16, vocab_size=8192,
                    bos_token_id=None, eos_token_id=None)
gen = torch.Generator().manual_seed(0)
pool = (torch.randn(2**26, generator=gen) * FP8_MAX / 4.5).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def random_release(spec):
    """A random tensor in the release's format: e4m3 slices of the pool, scaled to N(0, 1/fan_in)."""
    if spec.quantizable:
        start = int(torch.randint(0, pool.numel() - spec.numel, (), generator=gen))
        blocks = scale_shape(spec.shape, FP8Format().block)
        scale = torch.full(blocks, 4.5 / FP8_MAX / math.sqrt(spec.shape[1]))  # float32 scale_inv
        return pool[start:start + spec.numel].view(spec.shape), scale
    if spec.component == "norms" or spec.name.endswith("layernorm.weight"):
        return torch.ones(spec.shape)
    wide = 3 if spec.component == "router" else 1  # a router spread wide enough to avoid near-ties
    return torch.randn(spec.shape, generator=gen) * wide / math.sqrt(spec.shape[-1])


folder = Path(tempfile.mkdtemp(prefix="k2lab-slice-"))
write_checkpoint(folder, sliced, random_release)
on_disk = sum(f.stat().st_size for f in folder.iterdir())
print(f"{on_disk / 1e9:.2f} GB written: {[f.name for f in sorted(folder.iterdir())]}")

# %% [markdown]
# Load it with a budget of 10 of the 16 experts (in float32, the CPU's fast dtype): attention, router, shared expert,
# embedding and head become resident; the 16 routed experts stay in the file. Then prefill a prompt and decode a
# few tokens, and read the cache's counters.

# %%
expert_bytes = 3 * sliced.moe_intermediate_size * sliced.hidden_size * 4  # gate, up, down in float32
layer = k2lab.load(folder, dtype=torch.float32, expert_budget_bytes=10 * expert_bytes)
resident = sum(t.nbytes for t in [*layer.parameters(), *layer.buffers()])
print(f"resident {resident / GiB:.2f} GiB; expert budget {10 * expert_bytes / GiB:.2f} GiB "
      f"({expert_bytes / 2**20:.0f} MiB per expert)")
ids = torch.randint(0, sliced.vocab_size, (1, 8), generator=gen)  # [B=1, T=8] random ids
stats = layer.expert_cache.stats
out = k2lab.generate(layer, ids, max_new_tokens=3)
print(f"prefill 8 tokens + decode 3: {stats}")

# %%
# NBVAL_CHECK_OUTPUT
print("peak cached bytes within the budget:", stats.peak_bytes <= stats.budget_bytes)
per_matrix = sliced.moe_intermediate_size * sliced.hidden_size + 16 * 56 * 4  # e4m3 values + scales
print("every miss read one expert (3 matrices + scales):",
      stats.bytes_read == stats.misses * 3 * per_matrix)

# %% [markdown]
# ## Load the release yourself
#
# `k2lab.load` read that folder for you. Now you read it: the same files, into your own model. The release keeps
# every large matrix as e4m3 numbers, one byte each, with a float32 `weight_scale_inv` per 128 × 128 block beside it,
# and every routed expert as three tensors of its own; your model (the `my_k2` of [09](09_full_model.ipynb), built
# from your pieces) reads K2Model's state dict, which has no scales and stacks each layer's experts. A few of the
# folder's tensors, as the files hold them:

# %%
from safetensors import safe_open

stored = {}
for shard in sorted(folder.glob("*.safetensors")):
    with safe_open(shard, framework="pt") as f:
        stored.update({name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name in f.keys()})
for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
             "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv",
             "model.layers.0.mlp.experts.10.gate_proj.weight", "model.layers.0.mlp.experts.10.gate_proj.weight_scale_inv",
             "model.layers.0.mlp.gate.e_score_correction_bias", "model.embed_tokens.weight"):
    print(f"{name:<62} {stored[name][0]:<8} {stored[name][1]}")
print(f"{len(stored)} tensors in all, {sum(n.endswith('_scale_inv') for n in stored)} of them scales")

# %% [markdown]
# kv_a_proj_with_mqa has 576 rows, 4.5 blocks of 128: its scale grid is ceil(576 / 128) × ceil(7,168 / 128) = 5 × 56,
# and the last row of blocks is cut at the matrix's edge. (The name says *inverse*: DeepSeek's quantiser divided each
# block by a scale to fit e4m3's range and stored its inverse, so reading the weight back is a multiplication.)
#
# ### Exercise 1 ★★ · Write it yourself: FP8 to numbers
#
# `my_dequantize(weight, scale_inv)`: the float32 matrix [A, B] from its e4m3 values [A, B] and its block scales
# [ceil(A/128), ceil(B/128)]. Running the cell checks it (`exercises.check_dequantize`, on a matrix with cut edge
# blocks and one of whole blocks, against k2lab's FP8 reader; it names the slips it knows: the scale divided, the
# bytes read as integers, the grid tiled instead of spread over its blocks, no scale, bfloat16) and keeps it in your
# module.

# %%
@lab.mine
def my_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """weight [A, B] float8_e4m3fn, scale_inv [ceil(A/128), ceil(B/128)] float32 -> [A, B] float32"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Every stored value becomes a float, then is multiplied by the scale of the 128 × 128 block it sits in. Spread each
# scale over its block, 128 rows and 128 columns, and cut what overhangs the matrix's edges.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `weight.float()` decodes e4m3. `scale_inv.repeat_interleave(128, dim=0)[:A]` spreads the scales over the rows, and
# the same with `dim=1` and `[:, :B]` over the columns; multiply.

# %% [markdown] tags=["solution"]
# Decode, spread the scales block by block, cut at the edges, multiply:

# %% tags=["solution"]
# Solution (click to show)
def solution_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    A, B = weight.shape
    scales = scale_inv.repeat_interleave(128, dim=0)[:A].repeat_interleave(128, dim=1)[:, :B]  # [A, B]
    return weight.float() * scales


print(exercises.check_dequantize(solution_dequantize))

# %% [markdown]
# ### Exercise 2 ★★ · Write it yourself: the release as your model's state dict
#
# `my_release_to_state_dict(tensors, cfg, dtype)`: from the release's tensors by name (as the files hold them), K2Model's
# state dict in `dtype`: the names without `model.`, each FP8 matrix dequantised (use `mine.my_dequantize`, yours or
# the reference) and its scale dropped, each MoE layer's experts stacked in expert order into
# `layers.{i}.mlp.experts.gate_proj` [E, I, D], `up_proj` [E, I, D] and `down_proj` [E, D, I], and the router's
# correction bias kept in float32 (its differences decide the choice). Running the cell checks it
# (`exercises.check_release_state_dict`, against `k2lab.load` on a small K2 of 12 experts written in the release's
# format, in float32 and bfloat16) and keeps it.

# %%
mine = lab.mine.load("my_dequantize")


@lab.mine
def my_release_to_state_dict(tensors: dict[str, torch.Tensor], cfg: K2Config,
                             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """the release's tensors (model.-prefixed, FP8 with scales, one per expert) -> K2Model's state dict in dtype"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Three kinds of tensor. A scale is not a weight: it is used by the matrix beside it and then dropped. A matrix with
# a scale is dequantised; the others (embedding, head, norms, router) are only cast. An expert's three matrices join
# their layer's stacks, in expert order: expert 10's name sorts before expert 2's as text, so do not stack in the
# order the names come.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# One loop over the names that do not end in `_scale_inv` and are not experts' (`".mlp.experts." in name`): the new
# name is `name.removeprefix("model.")`, the value `mine.my_dequantize(t, tensors[name + "_scale_inv"])` when that
# scale exists, else `t`, then `.to(dtype)` (but `.float()` for a name ending in `e_score_correction_bias`). Then for
# each MoE layer `i` (`cfg.is_moe_layer(i)`) and each projection, `torch.stack([... for e in
# range(cfg.n_routed_experts)])` of the experts' dequantised matrices.

# %% [markdown] tags=["solution"]
# The scales with their matrices, the experts stacked by number:

# %% tags=["solution"]
# Solution (click to show)
def solution_release_to_state_dict(tensors: dict[str, torch.Tensor], cfg: K2Config,
                                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    def value(name: str) -> torch.Tensor:
        scale = tensors.get(name + "_scale_inv")
        return (mine.my_dequantize(tensors[name], scale) if scale is not None else tensors[name]).to(dtype)

    state = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv") or ".mlp.experts." in name:
            continue
        state[name.removeprefix("model.")] = t.float() if name.endswith("e_score_correction_bias") else value(name)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            for proj in ("gate_proj", "up_proj", "down_proj"):  # [E, I, D], [E, I, D], [E, D, I]
                state[f"layers.{i}.mlp.experts.{proj}"] = torch.stack(
                    [value(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for e in range(cfg.n_routed_experts)])
    return state


print(exercises.check_release_state_dict(solution_release_to_state_dict))

# %% [markdown]
# ### Your model on the release
#
# The whole folder through your two functions, into your model: `my_k2` from your module (yours if you have done
# [09](09_full_model.ipynb)'s exercise, else the reference assembly, which is built from your pieces of 02 to 04b
# all the same; the first lines say which piece is whose). In bfloat16, as `k2lab.load` keeps an FP8 checkpoint on a
# CPU, which also halves the 3.9 GB that float32 would take. Then the same against `k2lab.load` of the folder (the
# streamed model above, in float32), tensor by tensor and logit by logit, and against HF transformers' DeepseekV3
# holding your tensors, where it is installed.

# %%
from safetensors.torch import load_file

mine = lab.mine.load("my_dequantize", "my_release_to_state_dict", "my_k2", "my_mla", "my_router", "my_rms_norm",
                     "my_swiglu", "my_combine", "my_yarn")
tensors = {}
for shard in sorted(folder.glob("*.safetensors")):
    tensors.update(load_file(shard))
state = mine.my_release_to_state_dict(tensors, sliced, torch.bfloat16)
del tensors  # the FP8 values: the state dict holds its own
ours = mine.my_k2(state, sliced, ids)  # [1, 8, V]
print(f"my_release_to_state_dict: {len(state)} tensors, {sum(t.numel() for t in state.values()) / 1e9:.2f} B "
      f"numbers; my_k2's logits {list(ours.shape)}")

# %%
# NBVAL_CHECK_OUTPUT
resident = layer.state_dict()  # k2lab.load's, in float32; its routed experts stay in the files (streamed)
same = {name: torch.equal(state[name], t.to(state[name].dtype)) for name, t in resident.items()}
print(f"k2lab.load's resident tensors ({len(resident)}) are all in the state dict above: {set(resident) <= set(state)};"
      f" equal to its tensors once rounded to bfloat16, bit for bit: {all(same.values())}")
theirs = layer(ids)  # [1, 8, V] float32, the experts read from the files
gap = (ours.float() - theirs).abs().max().item() / theirs.abs().max().item()
print(f"logits: my_k2's and k2lab's agree within 3e-2 of the largest (bfloat16 keeps 8 bits): {gap < 3e-2}")
del layer  # the streamed model's memory back

# %%
print(f"max |my_k2's - k2lab's| / max |k2lab's| = {gap:.0e}")

# %%
hf, note = lab.hf_deepseek_v3(sliced, state)
if hf is None:
    print(note)
else:
    with torch.no_grad():
        hf_logits = hf(ids).logits
    print(f"{note}: max |my_k2's - HF's| / max |HF's| = "
          f"{(ours.float() - hf_logits.float()).abs().max().item() / hf_logits.abs().max().item():.0e}")
    del hf

# %% [markdown]
# The loader of your module (yours, or the reference: the first lines of the cell above say which) and k2lab's read
# the same numbers: both multiply each e4m3 value by its block's scale in float32, and the state dict is rounded once
# to bfloat16. The logits differ by bfloat16's rounding (k2lab's model here computes in float32); HF's DeepseekV3, a
# third implementation holding the same tensors, agrees to the same rounding. The real K2
# is this folder with 61 layers and 384 experts per layer: the same two functions load it, given the memory.

# %%
import shutil

del state
shutil.rmtree(folder)  # 1 GB of random weights: not worth keeping

# %% [markdown]
# ## Exercises
#
# The KV cache's bytes, which this notebook prints for K2 above, are [03](03_mla.ipynb)'s exercise
# (`check_kv_cache_bytes`); here the parameters and the placement.
#
# ### Exercise 3 ★★ · Write it yourself: one MoE block's parameters
#
# From a config alone, count one MoE block's parameters: its two RMSNorms, the MLA (with its latent norms), the
# router (W_gate and its correction bias), every routed expert and the shared expert(s). The check tries K2,
# Moonlight (no query latent, two shared experts: the config keys `q_lora_rank` and `n_shared_experts`) and K2-nano,
# against `block_parameters`, and names the slips it recognises. Running the cell checks it and keeps it in your module.

# %%
@lab.mine
def my_moe_block_parameters(cfg: K2Config) -> int:
    """parameters of one MoE block of ``cfg``"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# List the block's tensors as the checkpoint stores them (two norms; the attention's projections and its latents'
# norms; the router's matrix and bias; every expert's three matrices, routed and shared) and add up their sizes.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Name the widths first: D = `hidden_size`, H heads, N = `qk_nope_head_dim`, R = `qk_rope_head_dim`,
# V = `v_head_dim`, C = `kv_lora_rank`, Q = `q_lora_rank`, E experts of I = `moe_intermediate_size`, S shared. MLA's
# matrices: q_a_proj D × Q, q_b_proj Q × H(N + R) (or one q_proj D × H(N + R) when Q is None), kv_a_proj_with_mqa
# D × (C + R), kv_b_proj C × H(N + V), o_proj H·V × D; plus the norms of its latents. Every expert is 3 × D × I.

# %% [markdown] tags=["solution"]
# The block's tensors, in the checkpoint's order; for K2 the routed experts are 99.1% of the 17.06 billion (one MLA is
# 101,124,096 of them, as counted above):

# %% tags=["solution"]
# Solution (click to show)
def solution_moe_block_parameters(cfg: K2Config) -> int:
    D, H, N, R, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                     cfg.v_head_dim)
    C, Q, E, I, S = (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size,
                     cfg.n_shared_experts)
    query = D * H * (N + R) if Q is None else D * Q + Q + Q * H * (N + R)  # q_a_proj, its norm, q_b_proj
    attention = query + D * (C + R) + C + C * H * (N + V) + H * V * D  # kv_a, its norm, kv_b, o_proj
    router = E * D + E  # W_gate and the correction bias
    experts = (E + S) * 3 * D * I  # routed and shared SwiGLUs
    return 2 * D + attention + router + experts


print(exercises.check_moe_block_parameters(solution_moe_block_parameters))
print(f"K2: {solution_moe_block_parameters(k2):,} parameters per MoE block, "
      f"{k2.n_routed_experts * 3 * k2.hidden_size * k2.moe_intermediate_size / solution_moe_block_parameters(k2):.1%} "
      f"of them in the routed experts")

# %% [markdown]
# ### Exercise 4 ★ · Predict, then run: one expert's bytes
#
# How many bytes does ONE routed expert of K2 take in the release (three e4m3 matrices of 2,048 × 7,168, plus one
# float32 scale per 128 × 128 block)? And all 384 of one layer? Predict, then compute.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Count the values (one byte each) and the blocks (one float32 scale each) of one matrix, then three matrices per
# expert and 384 experts per layer.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# One byte per e4m3 value. A 2,048 × 7,168 matrix has ceil(2,048 / 128) × ceil(7,168 / 128) = 16 × 56 blocks, each
# with a 4-byte scale.

# %% [markdown] tags=["solution"]
# 3 × 2,048 × 7,168 bytes = 44.0 MB of e4m3 values, plus 3 × 16 × 56 float32 scales (10.8 kB); a layer's 384 experts
# are 16.9 GB, which is why the real-shape slice above keeps only 16 of them.

# %% tags=["solution"]
# Solution (click to show)
values = 3 * k2.moe_intermediate_size * k2.hidden_size
scales = 3 * math.ceil(k2.moe_intermediate_size / 128) * math.ceil(k2.hidden_size / 128) * 4
print(f"one expert: {values:,} + {scales:,} bytes; one layer's {k2.n_routed_experts}: "
      f"{k2.n_routed_experts * (values + scales) / 1e9:.1f} GB")

# %% [markdown]
# ### Exercise 5 ★★ · Change a knob: half the node
#
# Plan K2 on four 141 GB GPUs instead of eight (`k2lab.plan(k2, devices=[141 * 10**9] * 4)`). Predict first: does
# it fit, and if not, by how much does each device miss?

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Compare the weights' bytes with the room four devices leave after their headroom; then ask how whole blocks split
# over four devices.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Compare 1,029.2 GB of weights with 4 × (141 − 4.3) GB of room. With whole blocks, no device can take less than
# 15 of the 60 MoE blocks.

# %% [markdown] tags=["solution"]
# It does not fit, by far: 1,029.2 GB of weights against 564 GB of memory. The plan puts about 257 GB on each device
# (15 or 16 blocks), so every device misses by 115 to 118 GB: K2's FP8 weights need at least eight such GPUs, or
# the streamed experts of the next-to-last section.

# %% tags=["solution"]
# Solution (click to show)
print(k2lab.plan(k2, devices=[141 * 10**9] * 4))
