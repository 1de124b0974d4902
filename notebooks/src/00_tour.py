# %% [markdown]
# # 00 · A tour: one prompt through Kimi K2
#
# Kimi K2 is a mixture-of-experts language model with 1.03 trillion parameters, of which 32.9 billion work on
# any one token. It belongs to the DeepSeek-V3 family: 61 blocks, each with *multi-head latent attention* (MLA)
# and, from block 1 on, a *mixture of experts* (MoE) that sends every token to 8 of 384 small feed-forward
# networks plus one shared one.
#
# This lab runs the real architecture, written out in readable PyTorch (`k2lab`). On a laptop it runs
# **K2-nano**, a 6-block miniature with every one of K2's switches, trained for a few minutes on Python's own
# standard library, so expect it to write plausible Python and little else. On a GPU node the same notebooks run
# the real Kimi K2.
#
# This notebook follows one prompt through the whole pipeline in a dozen steps. Each step has its own notebook:
#
# | notebook | stage |
# | --- | --- |
# | [01 tokens](01_tokens.ipynb) | text to token ids: the pre-tokenizer, BPE, special tokens, the chat template |
# | [02 yarn](02_yarn.ipynb) | rotary positions and YaRN's stretch from 4K to 128K tokens |
# | [03 mla](03_mla.ipynb) | multi-head latent attention, naive and absorbed, and its small KV cache |
# | [04 router](04_router.ipynb) | how the sigmoid router with its correction bias picks experts |
# | [05 expert load](05_expert_load.ipynb) | load balance, specialisation and co-activation of the experts |
# | [06 logits](06_logits.ipynb) | from the residual stream to the next token: logit lens and attribution |
# | [07 interventions](07_interventions.ipynb) | ablate experts, force routes, edit the bias, patch activations |
# | [08 scale](08_scale.ipynb) | the real K2's parameters, bytes and memory; streaming experts |
# | [09 full model](09_full_model.ipynb) | the full K2 with probes, on a GPU node |
# | [10 training](10_training.ipynb) | how K2-nano was trained: MuonClip, QK-Clip, bias balancing |

# %% [markdown]
# ## The model
#
# The next cell is the lab's *parameter cell*. By default it loads K2-nano on the CPU. To run this notebook on
# the real model, start Jupyter with environment variables such as
# `K2LAB_MODEL=moonshotai/Kimi-K2-Instruct K2LAB_DEVICE_MAP=auto` (see `k2lab/lab.py` for all of them).

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()  # offline plotly figures, no autograd
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings)
print(about)

# %% [markdown]
# Every number that shapes the model sits in one frozen dataclass, `K2Config`, whose field names are those of the
# released `config.json`. Here are a few of them for the model we loaded, beside Kimi K2's:

# %%
# NBVAL_CHECK_OUTPUT
import torch

import k2lab
from k2lab import K2Config

k2 = K2Config.kimi_k2()
fields = ["hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
          "qk_nope_head_dim", "qk_rope_head_dim", "n_routed_experts", "num_experts_per_tok",
          "vocab_size"]
print(f"{'field':<22}{'this model':>12}{'Kimi K2':>12}")
for name in fields:
    print(f"{name:<22}{getattr(model.config, name):>12,}{getattr(k2, name):>12,}")

# %% [markdown]
# ## 1. Text to tokens
#
# The tokenizer cuts text into pieces by a regular expression, then merges bytes into tokens by byte-pair
# encoding. Each coloured box below is one token, its id underneath ([01 tokens](01_tokens.ipynb)).

# %%
from IPython.display import HTML

from k2lab import viz

prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return'
ids = torch.tensor([tok.encode(prompt)])  # [B=1, T]
tokens = [tok.id_to_piece(i) for i in ids[0].tolist()]
print(f"{len(prompt)} characters -> {ids.shape[1]} tokens")
HTML(viz.tokens_html(tok.pieces(prompt)))

# %% [markdown]
# ## 2. One forward pass, recorded
#
# The model embeds the ids into vectors of width D, sends them through the blocks and reads the next-token logits
# off the last one. Every stage has a named *probe*; `run_with_cache` records them all in one pass (this is how
# the rest of the lab looks inside). The residual stream keeps its shape [B, T, D] from the embedding to the end:

# %%
# NBVAL_CHECK_OUTPUT
logits, cache = model.run_with_cache(ids)
print(f"{len(cache)} probes recorded, e.g.")
for name in ["embed_tokens.hook_out", "layers.1.self_attn.hook_kv_latent",
             "layers.1.mlp.gate.hook_topk_idx", "layers.1.hook_resid_post", "hook_logits"]:
    print(f"  {name:<36} {list(cache[name].shape)}")

# %% [markdown]
# ## 3. Attention through a latent
#
# MLA compresses what each token offers to later tokens into one small latent vector (512 numbers in K2) plus
# one 64-number rotary key shared by all heads. Only these are cached while generating: 70,272 bytes per token
# for all of K2's 61 layers, against 2.4 MiB if every head's keys and values were cached
# ([03 mla](03_mla.ipynb)).

# %%
kv = model.new_cache(batch_size=1)
model(ids, cache=kv)
per_token = kv.nbytes // kv.length
print(kv)
print(f"{per_token:,} bytes per token here; K2: {k2lab.kv_cache_bytes(k2, 1):,} bytes per token "
      f"(expanded: {k2lab.kv_cache_bytes(k2, 1, layout='expanded'):,})")

# %% [markdown]
# ## 4. The router picks experts
#
# In every MoE block a router scores all experts for each token and keeps the top k. Here is what the prompt's
# last token chose in each layer, with the weights its experts' outputs were mixed by
# ([04 router](04_router.ipynb)):

# %%
from k2lab import routing

tr = routing.trace(model, ids)
for j, layer in enumerate(tr.layers):
    chosen = tr.indices[j, 0, -1].tolist()
    weights = ", ".join(f"{w:.2f}" for w in tr.weights[j, 0, -1].tolist())
    print(f"layer {layer}: experts {chosen}  weights [{weights}]")

# %% [markdown]
# ## 5. The next token
#
# The final norm and the output head turn the last position's residual into one logit per vocabulary entry; a
# softmax makes them probabilities ([06 logits](06_logits.ipynb)).

# %%
probs = logits[0, -1].softmax(-1)  # [V]
top = probs.topk(5)
for p, i in zip(top.values.tolist(), top.indices.tolist(), strict=True):
    print(f"{p:6.1%}  {tok.id_to_piece(i)!r}")

# %% [markdown]
# ## 6. What each layer was thinking: the logit lens
#
# Reading every layer's residual through the final norm and head shows the guess taking shape layer by layer.
# Each cell is a layer's top guess for the token after that position.

# %% tags=["nbval-ignore-output"]
viz.cache_logit_lens_figure(cache, tok.id_to_piece, tokens)  # the last 16 positions; 06_logits builds it by hand

# %% [markdown]
# ## 7. Generating through the latent cache
#
# `k2lab.generate` runs the prompt once (prefill), then one token per step, each step reading the cached
# latents instead of recomputing the past.

# %%
out = k2lab.generate(model, ids, max_new_tokens=24)  # greedy
print(prompt + tok.decode(out[0, ids.shape[1]:]))

# %% [markdown]
# ## Where next
#
# Start with [01 tokens](01_tokens.ipynb) and go in order, or jump to the stage you care about. For the real
# model's numbers (parameters, bytes, GPUs), see [08 scale](08_scale.ipynb).
