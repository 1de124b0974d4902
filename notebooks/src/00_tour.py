# %% [markdown]
# # 00 · A tour: one prompt through Kimi K2
#
# Kimi K2 is a mixture-of-experts language model with 1.03 trillion parameters, of which 32.9 billion work on
# any one token. It belongs to the DeepSeek-V3 family: 61 blocks, each with *multi-head latent attention* (MLA)
# and, from block 1 on, a *mixture of experts* (MoE) that sends every token to 8 of 384 small feed-forward
# networks plus one shared one.
#
# *Sources.* The shapes are those of the released `config.json` of Kimi-K2-Instruct. Counted from it, K2 has
# 1,026,408,232,448 parameters, and 32.9 billion are used per token if the embedding table and the output head are
# counted whole (k2lab's `count_parameters` reproduces both; notebook [08](08_scale.ipynb)). The K2 report (2025,
# Table 2) rounds to 1.04 trillion in all and gives 32.6 billion activated, without saying which tables its active
# count includes.
#
# This lab runs the real architecture, written out in readable PyTorch (`k2lab`). On a laptop it runs
# **K2-nano**, a 6-block miniature with every one of K2's switches, trained for 55 minutes on two CPU cores on
# Python's own standard library, so expect it to write plausible-looking Python and little else. On a GPU node the
# same notebooks run the real Kimi K2. Terms are explained in the [glossary](GLOSSARY.md).
#
# ## The map
#
# The whole pipeline, with the tensor shape at every arrow (B prompts of T tokens; K2's sizes, K2-nano's in
# brackets where they differ):
#
# ```mermaid
# flowchart TB
#   text["text"] -- "tokenizer (01)" --> ids["ids [B, T]"]
#   ids -- "embed_tokens" --> x0["residual stream x [B, T, 7168 (128)]"]
#   x0 --> blk
#   subgraph blk["one pre-norm block, × 61 (6): 04b"]
#     direction TB
#     n1["RMSNorm"] -- "[B, T, 7168]" --> mla["MLA (03): c_Q [B, T, 1536], c_KV [B, T, 512] + k_pe [B, T, 64],<br/>heads [B, T, 64, 192], rotated by RoPE/YaRN (02)"]
#     mla -- "attn_out [B, T, 7168]" --> a1(("+"))
#     a1 -- "[B, T, 7168]" --> n2["RMSNorm"]
#     n2 -- "[B, T, 7168]" --> ffn["block 0: dense SwiGLU<br/>blocks 1-60: router (04a) picks 8 of 384 [B, T, 8],<br/>experts [B, T, 8, 7168] + shared expert"]
#     ffn -- "mlp_out [B, T, 7168]" --> a2(("+"))
#   end
#   blk -- "x [B, T, 7168]" --> norm["final RMSNorm"]
#   norm -- "[B, T, 7168]" --> head["lm_head (06)"]
#   head -- "logits [B, T, 163840 (8192)]" --> next["next token: softmax, greedy or sampled"]
# ```
#
# This notebook follows one prompt through the pipeline in seven steps. Each step has its own notebook:
#
# | notebook | stage |
# | --- | --- |
# | [01 tokens](01_tokens.ipynb) | text to token ids: the pre-tokenizer, BPE, special tokens, the chat template |
# | [02 yarn](02_yarn.ipynb) | rotary positions and YaRN's stretch from 4K to 128K tokens |
# | [03 mla](03_mla.ipynb) | multi-head latent attention, naive and absorbed, and its small KV cache |
# | [04a router](04a_router.ipynb) | how the sigmoid router with its correction bias picks experts |
# | [04b block](04b_block.ipynb) | the pre-norm block by hand: RMSNorm, residuals, SwiGLU, shared expert, MoE combine |
# | [05 expert load](05_expert_load.ipynb) | load balance, specialisation and co-activation of the experts |
# | [06 logits](06_logits.ipynb) | from the residual stream to the next token: logit lens and attribution |
# | [07 interventions](07_interventions.ipynb) | ablate experts, force routes, edit the bias, patch activations |
# | [08 scale](08_scale.ipynb) | the real K2's parameters, bytes and memory; streaming experts |
# | [09 full model](09_full_model.ipynb) | the full K2 with probes, on a GPU node |
# | [10 training](10_training.ipynb) | how K2-nano was trained: MuonClip, QK-Clip, bias balancing; then you train your own |
# | [11 features and experts](11_features_experts.ipynb) | sparse dictionaries spliced into K2-nano: are experts made of features? |
#
# Every notebook has exercises, each marked ★ (predict, then run; a few lines), ★★ (change a knob, or write one
# piece) or ★★★ (write a piece that needs several others): predict, then run; change a knob; or write a piece
# yourself, checked by `k2lab.lab.exercises`, which runs your function against k2lab and names the mistake it
# recognises. Each exercise is followed by two folded hints (the idea first, then the code) and a folded solution
# (click to open; a solution's code and output stay hidden until you open them too, and the answer to a "predict"
# exercise sits in a fold of its own).
#
# **Your own K2.** Every piece you write carries `@lab.mine`, which checks it and keeps it in your own module,
# `mine.py` (in this folder): your BPE (01), your rotation and YaRN (02), your MLA (03), your router (04a), your
# norm, SwiGLU and block (04b), and onwards. [08](08_scale.ipynb) loads the real release's format into your model,
# [09](09_full_model.ipynb) assembles K2-nano from your module, with no copy and paste, and decodes with your own
# cache, and [10](10_training.ipynb) trains it. A piece you skip is k2lab's reference, and the cell that uses it says
# so.

# %% [markdown]
# ## The model
#
# The next cell is the lab's *parameter cell*. By default it loads K2-nano on the CPU. To run this notebook on
# the real model, start Jupyter with environment variables such as
# `K2LAB_MODEL=moonshotai/Kimi-K2-Instruct K2LAB_DEVICE_MAP=auto` (see `k2lab/lab/settings.py` for all of them).

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
# The tokenizer cuts text into pieces by a regular expression, then merges bytes into tokens by
# [byte-pair encoding](GLOSSARY.md#bpe). Each coloured box below is one token, its id underneath
# ([01 tokens](01_tokens.ipynb)). The prompt is the lab's running one, `lab.PROMPT`: notebooks 00 to 07 all follow
# it, so one token's attention, experts and logits can be compared from lesson to lesson.

# %%
from IPython.display import HTML

from k2lab import viz

prompt = lab.PROMPT
ids = model.to_tokens(prompt)  # [B=1, T], on the model's device
tokens = [tok.id_to_piece(i) for i in ids[0].tolist()]
print(f"{len(prompt)} characters -> {ids.shape[1]} tokens")
HTML(viz.tokens_html(tok.pieces(prompt)))

# %% [markdown]
# ## 2. One forward pass, recorded
#
# The model embeds the ids into vectors of width D, sends them through the blocks and reads the next-token logits
# off the last one. Every stage has a named *probe*; `run_with_cache` records them all in one pass (this is how
# the rest of the lab looks inside). The [residual stream](GLOSSARY.md#residual-stream) keeps its shape [B, T, D]
# from the embedding to the end:

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
# [MLA](GLOSSARY.md#mla) compresses what each token offers to later tokens into one small
# [latent](GLOSSARY.md#latent) vector (512 numbers in K2) plus one 64-number rotary key shared by all heads. Only
# these are cached while generating: 70,272 bytes per token for all of K2's 61 layers, against 2.4 MiB if every
# head's keys and values were cached, as the release's own `modeling_deepseek.py` does (both from the released
# config's widths; [03 mla](03_mla.ipynb) derives them).

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
# In every [MoE](GLOSSARY.md#moe) block a [router](GLOSSARY.md#router) scores all experts for each token and keeps
# the top k. Here is what the prompt's
# last token chose in each layer, with the weights its experts' outputs were mixed by
# ([04a router](04a_router.ipynb)):

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
# Reading every layer's residual through the final norm and head ([logit lens](GLOSSARY.md#logit-lens)) shows the
# guess taking shape layer by layer.
# Each cell is a layer's top guess for the token after that position.

# %% tags=["nbval-ignore-output"]
viz.cache_logit_lens_figure(cache, tok.id_to_piece, tokens)  # the last 16 positions; 06_logits builds it by hand

# %% [markdown]
# ## 7. Generating through the latent cache
#
# `k2lab.generate` runs the prompt once (prefill), then one token per step, each step reading the cached
# latents instead of recomputing the past. It decodes [greedily](GLOSSARY.md#greedy-decoding) by default.

# %%
out = k2lab.generate(model, ids, max_new_tokens=24)  # greedy
print(prompt + tok.decode(out[0, ids.shape[1]:]))

# %% [markdown]
# K2-nano continues the prompt in Python's style, but look at what it writes: after a few plausible tokens, greedy
# decoding in a model this small tends to repeat itself (a name, a line, a `return` pattern). Once a phrase has
# appeared twice, repeating it once more is the most likely continuation, and greedy decoding always takes the most
# likely one. A 6.6 M-parameter model trained for 55 minutes has little else to go on; sampling (exercise 2) breaks
# the loops, at the cost of sense.
#
# ## Where next
#
# Start with [01 tokens](01_tokens.ipynb) and go in order, or jump to the stage you care about. For the real
# model's numbers (parameters, bytes, GPUs), see [08 scale](08_scale.ipynb).
#
# ## Exercises
#
# ### Exercise 1 ★ · Predict, then run
#
# In step 5 the model's top guess after the prompt was ` r`. Which token does greedy generation in step 7 write
# first? Could it be any other? Predict, then compare `out[0, ids.shape[1]]` with the top guess.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Greedy decoding takes the argmax of the last position's logits. Which logits did step 5 read?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `out[0, ids.shape[1]]` is the first generated id; `top.indices[0]` is step 5's top guess.

# %% [markdown] tags=["solution"]
# The same: the first generated token is the argmax of exactly the logits step 5 read (the prompt's last position),
# so it must be the top guess, whatever its probability. Only from the second token on does generation read logits
# that step 5 never computed. (The cache changes how the logits are computed, not what they are.)

# %% tags=["solution"]
# Solution (click to show)
first = out[0, ids.shape[1]].item()
print(f"top guess {tok.id_to_piece(top.indices[0].item())!r}, first generated {tok.id_to_piece(first)!r}: "
      f"{first == top.indices[0].item()}")

# %% [markdown]
# ### Exercise 2 ★ · Change a knob
#
# Generate 24 tokens with `temperature=0.8, seed=0`, then with `temperature=0.8, seed=1`. Predict: do the greedy
# loops survive sampling?

# %%
# your code here: k2lab.generate(model, ids, max_new_tokens=24, temperature=0.8, seed=0)

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# With a temperature, each token is drawn from the softmax of the logits divided by 0.8. How likely is the loop's
# next token, and how many draws does it take for a less likely one to be picked?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# A loop over `seed in (0, 1)`, each `k2lab.generate(...)` decoded with `tok.decode(sampled[0, ids.shape[1]:])`.

# %% [markdown] tags=["solution"]
# Sampling draws each token from the softmax instead of taking its maximum, so a loop is broken as soon as a less
# likely token is drawn; the text wanders instead.

# %% tags=["solution"]
# Solution (click to show)
for seed in (0, 1):
    sampled = k2lab.generate(model, ids, max_new_tokens=24, temperature=0.8, seed=seed)
    print(f"seed {seed}: {tok.decode(sampled[0, ids.shape[1]:])!r}")

# %% [markdown]
# ### Exercise 3 ★ · Write it yourself: greedy decoding
#
# Without the cache: run the model on the ids, take the argmax of the last position's logits, append it, repeat.
# Replace the stub's `raise` with your code and run the cell: `@lab.mine` runs `exercises.check_greedy` on your
# function (your tokens against `k2lab.generate`'s, on K2-nano) and keeps it in your module, `mine.py`. Every "write
# it yourself" exercise of the course works this way.

# %%
from k2lab.lab import exercises


@lab.mine
def my_greedy(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """ids [1, T] -> [1, T + new_tokens]"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Each step needs only the logits of the last position: the model's best guess for the token after everything so
# far. Append that guess and the sequence is one token longer; do it `new_tokens` times.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `model(ids)` returns logits [1, T, V]; `[:, -1].argmax(-1, keepdim=True)` is the next id as [1, 1]; `torch.cat`
# it to `ids` along dimension 1, in a loop of `new_tokens` steps.

# %% [markdown] tags=["solution"]
# Each step runs the whole sequence again (the cache exists to avoid exactly that). The solution has a name of its
# own, `solution_greedy`, so running it never replaces yours:

# %% tags=["solution"]
# Solution (click to show)
def solution_greedy(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    for _ in range(new_tokens):
        next_id = model(ids)[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        ids = torch.cat([ids, next_id], dim=1)
    return ids


print(exercises.check_greedy(solution_greedy, model, ids))
