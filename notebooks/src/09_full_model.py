# %% [markdown]
# # 09 · The full model: build K2 from its weights, then run the real one
#
# This notebook has two parts.
#
# **Part 1, anywhere (K2-nano):** the end of the construction track. With the pieces you wrote in
# [02](02_yarn.ipynb) (YaRN's frequencies), [03](03_mla.ipynb) (MLA), [04a](04a_router.ipynb) (the router) and
# [04b](04b_block.ipynb) (RMSNorm, SwiGLU, the combine, the block), you compute K2's logits from nothing but its state
# dict, and check them against k2lab's model to 1e-5: first a small K2 with random weights, then K2-nano itself.
# Your model then generates text.
#
# **Part 2, on a GPU node with the real weights:** the full Kimi K2 with probes. What it needs:
#
# * the checkpoint: `moonshotai/Kimi-K2-Instruct` from the Hugging Face Hub (61 shards, about 959 GiB of FP8
#   weights; fetched into the Hub cache on first use, `HF_HUB_OFFLINE=1` then reads the cache) or a local folder
#   in the release layout;
# * memory for it: about 1.03 TB of GPU memory with the weights resident (eight 141 GB GPUs,
#   `K2LAB_DEVICE_MAP=auto`; see [08 scale](08_scale.ipynb)), or less with
#   `K2LAB_EXPERT_BUDGET_GIB=...` (routed experts streamed from disk; slow) and/or `K2LAB_NUM_LAYERS=...` (a
#   prefix of the blocks);
# * the variables set before Jupyter starts, for example
#
#       K2LAB_MODEL=moonshotai/Kimi-K2-Instruct K2LAB_DEVICE_MAP=auto jupyter lab notebooks/
#
# Anywhere else (no variables, no GPU, no weights) the parameter cell falls back to K2-nano and says why, and every
# cell runs the same code on it. Nothing in the code is K2-nano specific.
#
# **What the stored outputs show, and what they do not.** The outputs saved in this notebook are K2-nano's, because
# the lab is built on a CPU. K2-nano was trained on Python source and prose, never on a chat turn: the special
# tokens of the chat template never appeared in its training text. So its "answer" in Part 2 is not an answer, and
# its logit lens at the assistant's turn predicts noise. What does carry over to the real K2, unchanged: the probe
# names and the shapes they record, the way a chat prompt is laid out and routed token by token, how to read the
# routing heatmap, the load and the bias flips, and the logit lens read at the turn's first position. A real-shape
# MoE layer with experts streamed from disk runs in [08](08_scale.ipynb) on a CPU; the whole K2 needs the GPU node.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings, fallback_to_nano=True)
if settings.is_nano:
    about += " -- set K2LAB_MODEL to run the real K2 (see above)"
print(about)

# %% [markdown]
# # Part 1 · K2 from its weights, with your own pieces
#
# A model is its code plus a dictionary of tensors. k2lab's `K2Model` is one reading of that dictionary; in this
# part you write another, and the two must agree. Here is K2-nano's dictionary, `state_dict()`: the checkpoint's
# tensor names without the leading `model.` (the release stores each expert's matrices apart; k2lab stacks them per
# layer, [E, I, D] and [E, D, I]). One dense block, one MoE block, and the ends:

# %%
import torch
import torch.nn.functional as F

from k2lab.lab import exercises

nano, nano_tok = (model, tok) if settings.is_nano else lab.load_nano()  # Part 1 runs on K2-nano, whatever Part 2 runs
state = {name: t.detach() for name, t in nano.state_dict().items()}
for name, t in state.items():
    if name.startswith(("layers.0.", "layers.1.")) or not name.startswith("layers."):
        print(f"{name:<48} {str(list(t.shape)):<16} {str(t.dtype).removeprefix('torch.')}")
print(f"... and layers.2 to layers.{nano.config.num_hidden_layers - 1} like layers.1: {len(state)} tensors in all")

# %% [markdown]
# ## Your pieces
#
# Notebooks do not share their variables, so the pieces you wrote earlier are not defined here. The cell below
# defines each one with its exercise's signature, as a **stand-in built from k2lab's own modules** (or torch's): paste
# your own function over each stand-in to make the model entirely yours. Each stand-in names the notebook and the
# checker of its exercise, so you can re-check what you paste.

# %%
from k2lab.model.attention import MultiHeadLatentAttention
from k2lab.model.layers import SwiGLU
from k2lab.model.moe import Router
from k2lab.model.rope import inverse_frequencies


def my_yarn(cfg):
    """02, check_yarn_frequencies: cfg -> (inv_freq [R/2], softmax_scale). Stand-in: k2lab.model.rope."""
    return inverse_frequencies(cfg), cfg.softmax_scale


def my_mla(w, cfg, x, cos, sin):
    """03, check_mla_forward: MLA from its weights, x [B, T, D], cos and sin [T, R] -> [B, T, D], causal.
    Stand-in: k2lab's MultiHeadLatentAttention with these weights."""
    attn = MultiHeadLatentAttention(cfg).to(x.device)
    attn.load_state_dict(w)
    return attn(x, cos, sin, attn_impl="naive")


def my_router(x, weight, bias, top_k, scaling):
    """04a, check_router: x [N, D] -> (idx [N, k], weights [N, k]). Stand-in: k2lab's Router with these weights."""
    router = Router(nano.config.replace(num_experts_per_tok=top_k, routed_scaling_factor=scaling,
                                        n_routed_experts=weight.shape[0], hidden_size=weight.shape[1]))
    router.load_state_dict({"weight": weight, "e_score_correction_bias": bias})
    idx, w = router(x[None])
    return idx[0], w[0]


def my_rms_norm(x, weight, eps):
    """04b, check_rms_norm: x [..., D], weight [D] -> [..., D]. Stand-in: torch's F.rms_norm."""
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def my_swiglu(x, gate, up, down):
    """04b, check_swiglu: x [N, D], gate [I, D], up [I, D], down [D, I] -> [N, D]. Stand-in: k2lab's SwiGLU."""
    mlp = SwiGLU(gate.shape[1], gate.shape[0]).to(x.device)
    mlp.load_state_dict({"gate_proj.weight": gate, "up_proj.weight": up, "down_proj.weight": down})
    return mlp(x)

# %% [markdown]
# ### Exercise 1 ★★★ · Write it yourself: the whole K2
#
# Write `my_k2(state_dict, cfg, ids)` -> logits [B, T, V]: the embedding (a row of `embed_tokens.weight` per id),
# then every block as in [04b](04b_block.ipynb) (the first `cfg.first_k_dense_replace` with a dense SwiGLU, the
# others with the MoE: your router, the chosen experts, the shared expert, the combine), then the final norm and
# the untied head. Positions are 0 .. T−1, so the rotations are angle_t,i = t · inv_freq_i, written for features
# i and i + R/2 (the rotate-half layout that [03](03_mla.ipynb)'s MLA expects): `cos`, `sin` [T, R].
#
# The check first runs your function on a small K2 with random weights (3 blocks, 8 experts, norm weights far from
# one, a correction bias far from zero, so that the usual slips show) and compares its logits with k2lab's to 1e-5.
# It names what it recognises: a head tied to the embedding, the final norm forgotten, the bias in the weights, the
# routed scaling or the renormalisation forgotten, the choice made without the bias, the shared expert forgotten.
# Then the same on K2-nano.

# %%
def my_k2(state_dict: dict[str, torch.Tensor], cfg, ids: torch.Tensor) -> torch.Tensor:
    """state_dict: K2Model.state_dict() names; ids [B, T] -> logits [B, T, V]"""
    raise NotImplementedError


print(exercises.check_model_from_weights(my_k2))

# %% [markdown] tags=["hint"]
# Write it top-down. `x = state_dict["embed_tokens.weight"][ids]` is [B, T, D]. For block i with prefix
# `p = f"layers.{i}."`, the MLA's weights are the entries whose names start with `p + "self_attn."`, with that
# prefix removed (a dict comprehension). Each block: `x = x + my_mla(weights, cfg, my_rms_norm(x, ...), cos, sin)`,
# then `h = my_rms_norm(x, ...)` with the second norm and `x = x + ffn(h)`. For the MoE, flatten h to [B·T, D] for
# the router, run each chosen expert on the rows that chose it (`torch.where(idx == e)` gives rows and slots), add
# the shared expert and reshape back. End with `my_rms_norm(x, state_dict["norm.weight"], eps) @
# state_dict["lm_head.weight"].T`.

# %% [markdown] tags=["solution"]
# Three functions: the rotations, the MoE (the same loop as k2lab's reference, one pass per chosen expert), and the
# stack. YaRN's factor on cos and sin (mscale / mscale_all_dim, [02](02_yarn.ipynb)) is exactly 1 for K2's settings,
# and K2-nano's, so cos and sin are the plain ones of the YaRN frequencies.

# %% tags=["solution"]
def rotations(cfg, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq, _ = my_yarn(cfg)  # [R/2]
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq  # [T, R/2] position t, pair i
    angles = torch.cat([angles, angles], dim=-1)  # [T, R]: pair i's angle for features i and i + R/2
    return angles.cos(), angles.sin()


def moe(h: torch.Tensor, sd: dict[str, torch.Tensor], p: str, cfg) -> torch.Tensor:
    """h [N, D] -> [N, D]: router, chosen experts, shared expert, combine."""
    idx, w = my_router(h, sd[p + "gate.weight"], sd[p + "gate.e_score_correction_bias"], cfg.num_experts_per_tok,
                       cfg.routed_scaling_factor)  # [N, k] each
    out = h.new_zeros(*idx.shape, h.shape[-1])  # [N, k, D]
    for e in idx.unique().tolist():
        rows, slots = torch.where(idx == e)
        out[rows, slots] = my_swiglu(h[rows], *(sd[p + f"experts.{m}_proj"][e] for m in ("gate", "up", "down")))
    shared = my_swiglu(h, *(sd[p + f"shared_experts.{m}_proj.weight"] for m in ("gate", "up", "down")))
    return shared + (w[..., None] * out).sum(1)


def my_k2(state_dict: dict[str, torch.Tensor], cfg, ids: torch.Tensor) -> torch.Tensor:
    sd, eps = state_dict, cfg.rms_norm_eps
    cos, sin = rotations(cfg, ids.shape[1])
    x = sd["embed_tokens.weight"][ids]  # [B, T, D]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        attn_w = {n.removeprefix(p + "self_attn."): t for n, t in sd.items() if n.startswith(p + "self_attn.")}
        x = x + my_mla(attn_w, cfg, my_rms_norm(x, sd[p + "input_layernorm.weight"], eps), cos, sin)
        h = my_rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps)  # [B, T, D]
        if i < cfg.first_k_dense_replace:  # the dense block(s)
            x = x + my_swiglu(h, *(sd[p + f"mlp.{m}_proj.weight"] for m in ("gate", "up", "down")))
        else:
            x = x + moe(h.flatten(0, 1), sd, p + "mlp.", cfg).view_as(h)
    return my_rms_norm(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T  # [B, T, V], untied head


print(exercises.check_model_from_weights(my_k2))

# %% [markdown]
# Then the real test: K2-nano's own weights, its trained (non-zero) router bias included, on the lab's running
# prompt.

# %%
nano_ids = nano.to_tokens(lab.PROMPT)  # [1, T]
print(exercises.check_model_from_weights(my_k2, nano, nano_ids))

# %% [markdown]
# ## Your model generates
#
# Greedy decoding needs nothing but the logits: feed the sequence, append the argmax, repeat (without a cache, so
# each step recomputes the whole sequence). Your model must produce k2lab's tokens.

# %%
# NBVAL_CHECK_OUTPUT
import k2lab

with torch.no_grad():
    mine = nano_ids.cpu()
    for _ in range(8):
        mine = torch.cat([mine, my_k2(state, nano.config, mine)[:, -1:].argmax(-1)], dim=1)
print("same tokens as k2lab.generate:", torch.equal(mine, k2lab.generate(nano, nano_ids, max_new_tokens=8).cpu()))
print(repr(nano_tok.decode(mine[0, nano_ids.shape[1]:])))

# %% [markdown]
# The continuation is K2-nano's greedy loop, the one [06](06_logits.ipynb) explains: a 6.6 M-parameter model, once
# a phrase repeats, finds repeating it again the likeliest step. Your code computes exactly what k2lab's does; on
# the real K2's state dict it would compute the real K2, given the memory of Part 2 (and the FP8 weights
# dequantized, which `k2lab.load` does).

# %% [markdown]
# # Part 2 · The real K2, with probes
#
# ## A real prompt
#
# A chat turn, laid out by K2's [chat template](GLOSSARY.md#chat-template) (see [01 tokens](01_tokens.ipynb)):

# %%
import torch

question = "Write a Python function that checks whether a string is a palindrome."
messages = [{"role": "user", "content": question}]
ids = torch.tensor([tok.apply_chat_template(messages)], device=model.device)  # [B=1, T], ends with the assistant's header
tokens = [tok.id_to_piece(i) for i in ids[0].tolist()]
print(f"{ids.shape[1]} tokens; the last ones: {tokens[-6:]}")

# %% [markdown]
# One forward pass records the router probes and the residual stream. Recorded tensors are moved to the CPU
# (`device="cpu"`), which also gathers them from several GPUs.

# %%
from k2lab import routing

wanted = lambda name: ".mlp.gate." in name or name.endswith("hook_resid_post")
logits, cache = model.run_with_cache(ids, names=wanted, device="cpu")
tr = routing.RoutingTrace.from_cache(cache)  # [L_moe, B, T, ...]
print(f"{len(tr.layers)} MoE layers, top-{tr.indices.shape[-1]} of {tr.scores.shape[-1]} experts")

# %% [markdown]
# ## The routing heatmap
#
# Pick a layer: each row is a token of the prompt, each coloured cell an expert it used, coloured by its weight.
# Look for columns that light up for the template's tokens (the `<|im_...|>` markers, role names) or for runs of
# similar words.

# %% tags=["nbval-ignore-output"]
from k2lab import viz

viz.widgets.routing_explorer(tr, tokens)

# %% [markdown]
# Where do the template's tokens go? The chat markers are the same in every conversation, and attention is
# causal, so the markers before the user's text are routed the same whatever the question. The last MoE layer's
# experts for each special token, against those of the question's words:

# %%
specials = set(tok.special_tokens.values())
last = tr.layers[-1]
for t, token_id in enumerate(ids[0].tolist()):
    if token_id in specials or t == ids.shape[1] - 1:
        print(f"position {t:>2} {tokens[t]!r:<18} experts {tr.indices[tr.row(last), 0, t].tolist()}")
text_positions = [t for t, i in enumerate(ids[0].tolist()) if i not in specials]
print(f"{len(text_positions)} ordinary tokens use {len(set(tr.indices[tr.row(last), 0, text_positions].flatten().tolist()))} "
      f"distinct experts in layer {last}")

# %% [markdown]
# In K2-nano the markers share a few experts (the same three or four recur): their embeddings were never trained,
# so they look alike to the router. On the real K2, trained on many chat turns, the same table shows which experts
# serve the template.
#
# Over the whole prompt, how evenly were the experts used, layer by layer? (One prompt is a small sample: expect
# many idle experts, drawn in grey.)

# %% tags=["nbval-ignore-output"]
counts = routing.expert_counts(tr)  # [L_moe, E]
viz.load_figure(routing.relative_load(counts), tr.layers, title="Expert load on this prompt")

# %% [markdown]
# And where did the correction bias change a token's experts?

# %% tags=["nbval-ignore-output"]
viz.bias_flip_figure(tr.bias_flips[:, 0].float().mean(-1), tr.layers)

# %% [markdown]
# ## The next token, layer by layer
#
# What does the model "say" after each block, at the last position (the assistant's turn is about to begin)? The
# logit lens of [06](06_logits.ipynb) answers it: apply the final norm and the head to a middle layer's residual,
# as if the model stopped there.
#
# ### Exercise 2 ★ · Write it yourself: the logit lens
#
# From one layer's residual stream, the logits the model would give if it stopped there. Then apply it to every
# layer's `hook_resid_post` at the last position and compare with `cache.logit_lens(pos=-1)`.

# %%
def my_logit_lens(resid: torch.Tensor, norm, head) -> torch.Tensor:
    """resid [T, D]; norm, head: the model's final norm and lm_head -> logits [T, V] (float32)"""
    raise NotImplementedError


print(exercises.check_logit_lens(my_logit_lens))

# %% [markdown] tags=["hint"]
# The same two steps as after the last block ([06](06_logits.ipynb)): `head(norm(resid))`, returned in float32.
# Not a softmax: logits.

# %% [markdown] tags=["solution"]
# The final norm, then the head, in float32; then every layer's last position through it:

# %% tags=["solution"]
def my_logit_lens(resid: torch.Tensor, norm, head) -> torch.Tensor:
    return head(norm(resid)).float()


print(exercises.check_logit_lens(my_logit_lens))

# %% [markdown]
# Your lens over the layers (every layer of K2-nano; about twelve of the real K2's 61):

# %%
resid = cache.stack("hook_resid_post")[:, 0, -1].to(model.device, model.dtype)  # [L, D] the last position
lens = my_logit_lens(resid, model.norm, model.lm_head).cpu()  # [L, V]
print("equal to cache.logit_lens(pos=-1):", torch.allclose(lens, cache.logit_lens(pos=-1)[:, 0], atol=1e-4))
top = lens.softmax(-1).max(-1)
for layer, (p, i) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
    if layer % max(1, len(lens) // 12) == 0 or layer == len(lens) - 1:
        print(f"layer {layer:>2}: {tok.id_to_piece(i)!r:<16} p = {p:.2f}")

# %% [markdown]
# On K2-nano the middle layers predict a comma or a newline and the last layer spreads its probability thin: the
# assistant's header is text it never saw, so no layer knows what follows it. On the real K2 this table shows at
# which depth the first word of the answer takes shape.
#
# ## The answer
#
# Greedy decoding through the latent cache:

# %%
import k2lab

out = k2lab.generate(model, ids, max_new_tokens=40)
print(tok.decode(out[0, ids.shape[1]:]))

# %% [markdown]
# On the real K2 this is the start of an answer. From K2-nano it is Python-flavoured noise that soon repeats
# itself: a model that never saw an assistant's turn continues it with the only text it knows (docstring prose
# from the standard library), and greedy decoding in a small model falls into loops ([00](00_tour.ipynb)).
#
# ## More exercises
#
# ### Exercise 3 ★★ · Predict, then run: which positions can a new question re-route?
#
# Change the question (keep it one user message) and trace the routing again. For which positions can the experts
# change, and for which can they not? Predict from the causal mask, then compare the two traces position by
# position.

# %%
# your code here

# %% [markdown] tags=["hint"]
# A token's router input depends only on the tokens up to it (attention is causal). Find the first position where
# the two id sequences differ; compare `tr.indices[:, 0, t]` of both traces (`routing.trace(model, other_ids)`)
# before and after it.

# %% [markdown] tags=["solution"]
# Every position before the first token that differs routes identically in every layer: it cannot see the
# question. From there on anything may change. With "Sort a list of numbers in Python." the first difference is at
# position 29 (the question's first word); positions 0 to 28 route identically, and none of the 15 positions after
# that which both prompts have keeps all its experts in every layer (K2-nano's answer, printed below).

# %% tags=["solution"]
other = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "Sort a list of numbers in Python."}])],
                     device=model.device)
tr_other = routing.trace(model, other)
first = next(t for t, (a, b) in enumerate(zip(ids[0].tolist(), other[0].tolist(), strict=False)) if a != b)
same = [torch.equal(tr.indices[:, 0, t], tr_other.indices[:, 0, t].to(tr.indices.device))  # tr was gathered to the CPU
        for t in range(min(ids.shape[1], other.shape[1]))]
print(f"first differing token at position {first}; routing identical at positions 0..{first - 1}: {all(same[:first])}; "
      f"identical afterwards at {sum(same[first:])} of {len(same) - first} shared positions")

# %% [markdown]
# ### Exercise 4 ★ · Change a knob: your own system message
#
# Give the conversation your own system message (`{"role": "system", "content": ...}` first) and count the tokens:
# how many does K2's default system prompt take?

# %%
# your code here

# %% [markdown] tags=["hint"]
# The template adds a default system turn when the conversation has none (`k2lab.tokenizer.chat.DEFAULT_SYSTEM_PROMPT`).
# The system turn ends where the user's begins: look for the id of `<|im_user|>` (`tok.special_tokens`).

# %% [markdown] tags=["solution"]
# The default system message ("You are Kimi, an AI assistant created by Moonshot AI.") is added only when none is
# given. With K2-nano's tokenizer it takes 26 of the prompt's 52 tokens: its turn runs from `<|im_system|>` to its
# `<|im_end|>`, and 22 of those tokens are the message's text. With "Be brief." the system turn is 10 tokens and the
# whole prompt 36. These counts come from K2-nano's tokenizer; with `K2LAB_MODEL` set, the cell prints those of K2's
# own (the default prompt is the release's chat template, `tokenizer_config.json`).

# %% tags=["solution"]
from k2lab.tokenizer.chat import DEFAULT_SYSTEM_PROMPT

own = [{"role": "system", "content": "Be brief."}, *messages]
with_own = tok.apply_chat_template(own)
user_turn = tok.special_tokens["<|im_user|>"]  # each system turn ends where the user's turn begins
print(f"the default system turn: {ids[0].tolist().index(user_turn)} of the prompt's {ids.shape[1]} tokens, "
      f"{len(tok.encode(DEFAULT_SYSTEM_PROMPT))} of them its text")
print(f"with 'Be brief.': a system turn of {with_own.index(user_turn)} tokens, {len(with_own)} in all")
